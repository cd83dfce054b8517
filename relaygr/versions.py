"""Model versions as a routing dimension: which version serves a user, and that version's rankers.

Pure: no I/O. The router and the trigger both call `choose_version` with the same live policy
(etcd key `versions_key(prefix)`, followed by `relaygr.live_value.live_policy`) and the same
membership view, so a user's PreInfer, its Rank and the trigger's admission agree on the
version, and then hash over that version's rankers only (`serving`).
"""

import hashlib
import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Self

from relaygr.cluster import RankerRecord
from relaygr.errors import ConfigError
from relaygr.json_object import json_object

_FIELDS = ("current", "canary", "canary_fraction")


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """Which model version serves users who do not ask for one.

    `current` (empty: none named) serves everyone but the canary users; `canary` (empty: no
    canary) serves the users whose `canary_point` is below `canary_fraction`. Invariants
    (checked on construction, ConfigError otherwise): `canary_fraction` is a finite number in
    [0, 1]; a positive fraction names a `canary`; no version contains "/" (the directory keys
    entries by version). The default policy names nothing: the majority version serves.
    """

    current: str = ""
    canary: str = ""
    canary_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("current", "canary"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"versions: {name} must be a string, got {value!r}")
            check_version(value, f"versions: {name}")
        fraction = self.canary_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ConfigError(f"versions: canary_fraction must be a number, got {fraction!r}")
        if not (math.isfinite(fraction) and 0.0 <= fraction <= 1.0):
            raise ConfigError(f"versions: canary_fraction must be in [0, 1], got {fraction!r}")
        object.__setattr__(self, "canary_fraction", float(fraction))
        if fraction > 0 and not self.canary:
            raise ConfigError("versions: canary_fraction > 0 needs a canary version")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "versions") -> Self:
        """The policy a JSON object states (keys `current`, `canary`, `canary_fraction`, each
        optional); ConfigError names an unknown key or a bad value."""
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ConfigError(f"{source}: unknown keys {unknown}; valid keys are {list(_FIELDS)}")
        return cls(**data)

    @classmethod
    def from_json(cls, raw: bytes, source: str = "versions") -> Self:
        """Parse `raw` (a JSON object); ConfigError says what is wrong."""
        return cls.from_mapping(json_object(raw, source, ConfigError), source)

    def to_json(self) -> bytes:
        return json.dumps({name: getattr(self, name) for name in _FIELDS}, sort_keys=True).encode()


def versions_key(etcd_prefix: str) -> str:
    """The etcd key holding the live `VersionPolicy` (a JSON object)."""
    return f"{etcd_prefix.rstrip('/')}/config/versions"


def check_version(version: str, what: str = "model_version") -> None:
    """A version names a directory namespace: it may not contain "/" (ConfigError)."""
    if "/" in version:
        raise ConfigError(f"{what} must not contain '/', got {version!r}")


def canary_point(user: str) -> float:
    """The user's stable point in [0, 1): a canary user when below the canary fraction.

    A keyed 64-bit BLAKE2b of the user id (its own personalisation, independent of placement's
    rendezvous weights), the same in every process; raising the fraction only adds users.
    """
    digest = hashlib.blake2b(user.encode(), digest_size=8, person=b"relaygr-canary").digest()
    return int.from_bytes(digest, "big") / 2.0**64


def live_versions(view: Mapping[str, RankerRecord]) -> Counter[str]:
    """version -> how many rankers of `view` serve it."""
    return Counter(record.model_version for record in view.values())


def choose_version(
    user: str, asked: str, policy: VersionPolicy, live: Mapping[str, int]
) -> str | None:
    """The model version that serves `user`'s request; None when none can.

    `live` maps each version to its live rankers (`live_versions`). In order:
    1. a version `asked` for is the answer if any ranker serves it, else None (the caller's
       UNAVAILABLE names it): a request is never scored by another version than it asked for;
    2. a canary user (`canary_point(user) < policy.canary_fraction`) gets `policy.canary` when
       it is live;
    3. `policy.current`, when it is live;
    4. else (no policy, or its versions are gone) the version most live rankers serve, ties
       broken by the greatest version string; None when no ranker is live.
    """
    if asked:
        return asked if live.get(asked, 0) > 0 else None
    canary_live = policy.canary and live.get(policy.canary, 0) > 0
    if canary_live and canary_point(user) < policy.canary_fraction:
        return policy.canary
    if policy.current and live.get(policy.current, 0) > 0:
        return policy.current
    serving_versions = [(n, version) for version, n in live.items() if n > 0]
    return max(serving_versions)[1] if serving_versions else None


def serving(view: Mapping[str, RankerRecord], version: str) -> dict[str, RankerRecord]:
    """The rankers of `view` that serve `version`: the only ones its requests may go to."""
    return {i: r for i, r in view.items() if r.model_version == version}


@dataclass(frozen=True, slots=True)
class VersionIndex:
    """A membership view split by model version: each version's live count and its rankers.

    Built once per view: membership views are snapshots, replaced (never changed in place) when
    a ranker joins or leaves, so the index of the last view serves every request until then.
    """

    view: Mapping[str, RankerRecord]
    live: Mapping[str, int]  # `live_versions(view)`
    rankers: Mapping[str, Mapping[str, RankerRecord]]  # version -> `serving(view, version)`
    # version -> the ids of `rankers[version]`: one set object per view, so placement's
    # rendezvous order (`relaygr.placement.ranking`) finds its member set without copying ids
    ids: Mapping[str, frozenset[str]]

    @classmethod
    def of(cls, view: Mapping[str, RankerRecord]) -> "VersionIndex":
        split: dict[str, dict[str, RankerRecord]] = {}
        for instance, record in view.items():
            split.setdefault(record.model_version, {})[instance] = record
        rankers = {version: MappingProxyType(mine) for version, mine in split.items()}
        live = Counter({version: len(mine) for version, mine in split.items()})
        ids = {version: frozenset(mine) for version, mine in split.items()}
        return cls(view, live, rankers, ids)

    def serving(self, version: str) -> Mapping[str, RankerRecord]:
        """The rankers that serve `version` (none: empty)."""
        return self.rankers.get(version, _NONE)

    def serving_ids(self, version: str) -> frozenset[str]:
        """The ids of `serving(version)`."""
        return self.ids.get(version, frozenset())


_NONE: Mapping[str, RankerRecord] = MappingProxyType({})


class VersionIndexer:
    """The index of the last view asked about, rebuilt only when the view object changes."""

    def __init__(self) -> None:
        self._last: VersionIndex | None = None

    def __call__(self, view: Mapping[str, RankerRecord]) -> VersionIndex:
        last = self._last
        if last is None or last.view is not view:
            last = self._last = VersionIndex.of(view)
        return last


def unavailable_message(version: str, live: Mapping[str, int]) -> str:
    """What a request for `version` is told when no live ranker serves it."""
    known = ", ".join(f"{v} ({n})" for v, n in sorted(live.items()) if n > 0) or "none"
    return f"no live ranker serves model version {version!r}; live versions (rankers): {known}"
