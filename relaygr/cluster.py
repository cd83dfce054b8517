"""Cluster ports shared by router, trigger and ranker: ranker membership and placement directory."""

import contextlib
import dataclasses
import json
import math
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar

from relaygr.cost import CACHED_TERMS, CostModel
from relaygr.errors import InvalidInput
from relaygr.json_object import json_object

_MAX_PORT = 65535
_COSTS = (
    "fixed_ms", "per_token_ms", "per_pair_ms", "per_candidate_key_ms", "reload_ms_per_mb",
    "median_abs_rel_error", "batch_saving_ms", *CACHED_TERMS,
)  # fmt: skip

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RankerRecord:
    """What a ranker registers under its lease: where it listens, its model, budgets, cost model.

    Invariants (checked on construction, so a record from the store is usable as is): ids,
    address and model version are non-empty strings, the version without "/" (it names a
    directory namespace); `address` is "host:port" with a port in 1..65535; budgets and bytes
    per token are non-negative ints; cost coefficients are finite, non-negative floats (see
    `services.ranker.cost_model.CostModel` for their meaning).
    """

    instance_id: str
    address: str
    model_version: str
    hbm_budget_bytes: int
    dram_budget_bytes: int
    # Bytes a cached prefix token charges a tier, its timestamp included (what Describe reports
    # as ModelDims.cache_bytes_per_token); the record's key name predates that field.
    kv_bytes_per_token: int
    fixed_ms: float
    per_token_ms: float
    per_pair_ms: float
    per_candidate_key_ms: float
    reload_ms_per_mb: float
    # How far to trust the cost model (`CostModel.median_abs_rel_error` and `samples`); absent
    # from an older ranker's record, read as 0 (not known).
    median_abs_rel_error: float = 0.0
    cost_samples: int = 0
    # What batching saves per request after the first (`CostModel.batch_saving_ms` and
    # `batch_samples`); absent from an older ranker's record, read as 0 (not known).
    batch_saving_ms: float = 0.0
    batch_samples: int = 0
    # The cached-rank terms (`relaygr.cost.CACHED_TERMS`); absent from an older ranker's
    # record, read as 0 (not fitted).
    cached_fixed_ms: float = 0.0
    cached_per_row_ms: float = 0.0
    cached_per_key_ms: float = 0.0
    cached_per_row_key_ms: float = 0.0

    def __post_init__(self) -> None:
        _check_fields(self)
        if "/" in self.model_version:
            raise InvalidInput(f"model_version must not contain '/', got {self.model_version!r}")
        for name in _COSTS:
            if getattr(self, name) < 0:
                raise InvalidInput(f"{name} must be non-negative, got {getattr(self, name)!r}")
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= _MAX_PORT:
            raise InvalidInput(f"ranker address must be host:port, got {self.address!r}")

    def cost_model(self) -> CostModel:
        """The latency model the ranker published."""
        return CostModel(
            **{name: getattr(self, name) for name in _COSTS},
            samples=self.cost_samples,
            batch_samples=self.batch_samples,
        )

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> Self:
        """Parse a stored record; raises InvalidInput naming what is wrong.

        Unknown keys are ignored, so an older reader accepts a newer ranker's record.
        """
        return cls.from_object(json_object(data, cls.__name__, InvalidInput))

    @classmethod
    def from_object(cls, raw: Mapping[str, Any]) -> Self:
        """The record in a stored JSON object already parsed (`from_json` less the parse)."""
        return _from_object(cls, raw)


@dataclass(frozen=True, slots=True)
class PlacementRecord:
    """A user's prefix cache for `model_version` lives on `instance_id` until `expires_at`
    (wall-clock seconds).

    Invariants: ids are non-empty strings; `expires_at` is a finite float; `model_version`
    contains no "/" (it names the entry's directory namespace). An empty version is a record
    written before versions were a routing dimension (or by a caller without one): it is never
    found under a named version.
    """

    user_id: str
    instance_id: str
    expires_at: float
    model_version: str = ""

    def __post_init__(self) -> None:
        _check_fields(self)
        if "/" in self.model_version:
            raise InvalidInput(f"model_version must not contain '/', got {self.model_version!r}")

    def to_json(self) -> bytes:
        return _to_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> Self:
        """Parse a stored record; raises InvalidInput naming what is wrong."""
        return cls.from_object(json_object(data, cls.__name__, InvalidInput))

    @classmethod
    def from_object(cls, raw: Mapping[str, Any]) -> Self:
        """The record in a stored JSON object already parsed (`from_json` less the parse)."""
        return _from_object(cls, raw)


class Membership(Protocol):
    """The live rankers. `view` reads the local watched copy and never does I/O."""

    async def register(self, record: RankerRecord, ttl_s: float) -> None:
        """Publish `record` under a lease of `ttl_s` that the implementation keeps alive."""

    async def deregister(self, instance_id: str) -> None:
        """Withdraw the instance; its directory entries go with it."""

    def view(self) -> Mapping[str, RankerRecord]:
        """instance id -> record, as last seen; a snapshot that later changes do not alter, and
        the same object until the membership changes (so an index of it may be kept by
        identity: `relaygr.versions.VersionIndexer`)."""


class Directory(Protocol):
    """Where users' caches live when not on their hash owner, per model version: a user has at
    most one entry per version, and an entry is only ever found under its own version (a
    prefix computed by one version is never sent to be consumed by another). `entry` and
    `lookup` never do I/O."""

    async def record(self, placement: PlacementRecord, holder_instance_id: str) -> bool:
        """Record `placement` under its `model_version`, bound to the holder's lease so it
        dies with that instance.

        Returns False (and records nothing) when the holder is not a live member.
        """

    def entry(self, user_id: str, model_version: str) -> PlacementRecord | None:
        """The user's live placement under `model_version`, or None when absent or expired."""

    def lookup(self, user_id: str, model_version: str) -> str | None:
        """The recorded instance for the user under `model_version`, or None when absent or
        expired."""

    async def forget_instance(self, instance_id: str) -> None:
        """Drop every entry held by or placed on the instance."""


class MemoryCluster:
    """Membership and directory in one process's dicts: for unit tests and single-process mode.

    Leases never lapse here (the process keeps them alive for as long as it runs); an instance
    leaves only by `deregister`, which also drops every directory entry it holds or is named in.
    A directory entry is visible while `clock() < expires_at`, with `clock` in wall-clock
    seconds. `view()` returns a snapshot: membership changes replace the dict instead of
    mutating it, so a caller iterating a view across an `await` is never disturbed.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._rankers: dict[str, RankerRecord] = {}
        self._view = types.MappingProxyType(self._rankers)
        # (model version, user id) -> (placement, holder instance id)
        self._placements: dict[tuple[str, str], tuple[PlacementRecord, str]] = {}

    # The ports' async methods do no I/O here: each is its synchronous twin, which a caller
    # on a virtual clock (the simulator) calls directly.

    async def register(self, record: RankerRecord, ttl_s: float) -> None:
        self.join(record, ttl_s)

    def join(self, record: RankerRecord, ttl_s: float) -> None:
        """`register`, now."""
        if not ttl_s > 0:
            raise InvalidInput(f"lease ttl_s must be positive, got {ttl_s}")
        self._rankers = {**self._rankers, record.instance_id: record}
        self._view = types.MappingProxyType(self._rankers)

    async def deregister(self, instance_id: str) -> None:
        self.leave(instance_id)

    def leave(self, instance_id: str) -> None:
        """`deregister`, now."""
        self._rankers = {k: v for k, v in self._rankers.items() if k != instance_id}
        self._view = types.MappingProxyType(self._rankers)
        self.forget(instance_id)

    def view(self) -> Mapping[str, RankerRecord]:
        return self._view

    async def record(self, placement: PlacementRecord, holder_instance_id: str) -> bool:
        return self.put(placement, holder_instance_id)

    def put(self, placement: PlacementRecord, holder_instance_id: str) -> bool:
        """`record`, now."""
        if holder_instance_id not in self._rankers:
            return False
        key = (placement.model_version, placement.user_id)
        self._placements[key] = (placement, holder_instance_id)
        return True

    def entry(self, user_id: str, model_version: str) -> PlacementRecord | None:
        key = (model_version, user_id)
        entry = self._placements.get(key)
        if entry is None:
            return None
        placement, _ = entry
        if self._clock() >= placement.expires_at:
            del self._placements[key]
            return None
        return placement

    def placements(self) -> int:
        """Directory entries held, expired ones not yet noticed included."""
        return len(self._placements)

    def lookup(self, user_id: str, model_version: str) -> str | None:
        placement = self.entry(user_id, model_version)
        return None if placement is None else placement.instance_id

    async def forget_instance(self, instance_id: str) -> None:
        self.forget(instance_id)

    def forget(self, instance_id: str) -> None:
        """`forget_instance`, now."""
        self._placements = {
            key: (placement, holder)
            for key, (placement, holder) in self._placements.items()
            if instance_id not in (holder, placement.instance_id)
        }


def _check_fields(value: Any) -> None:
    """Check each field against its annotation: str non-empty (unless its default is ""), int
    non-negative, float finite.

    JSON writes 1.0 as 1, so an int where a float is declared is accepted and stored as float.
    """
    for field in dataclasses.fields(value):
        name, v = field.name, getattr(value, field.name)
        if field.type is str:
            if not isinstance(v, str) or (not v and field.default != ""):
                raise InvalidInput(f"{name} must be a non-empty string, got {v!r}")
        elif field.type is int:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidInput(f"{name} must be a non-negative integer, got {v!r}")
        elif field.type is float:
            number = None
            if isinstance(v, int | float) and not isinstance(v, bool):
                with contextlib.suppress(OverflowError):  # an int beyond float range
                    number = float(v)
            if number is None or not math.isfinite(number):
                raise InvalidInput(f"{name} must be a finite number, got {v!r}")
            object.__setattr__(value, name, number)


def _to_json(value: Any) -> bytes:
    return json.dumps(dataclasses.asdict(value), sort_keys=True, separators=(",", ":")).encode()


def _from_object(cls: type[T], raw: Mapping[str, Any]) -> T:
    kind = cls.__name__
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    required = [f.name for f in fields if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in raw]
    if missing:
        raise InvalidInput(f"{kind}: missing fields {', '.join(missing)}")
    # A field with a default was added later: a record written before it lacks it.
    return cls(**{f.name: raw[f.name] for f in fields if f.name in raw})
