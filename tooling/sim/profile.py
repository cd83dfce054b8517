"""Device profiles: what one ranker costs and holds, from a file a user can write (TOML).

A profile is either measured (a ranker's calibrated cost model, read from a live ranker with
`relaygr simulate --profile-from HOST:PORT`) or assumed (figures cited from public sources,
each listed under `sources`, every guess under `assumptions`). See docs/simulator.md.
"""

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from relaygr.cost import CACHED_TERMS, CostModel
from relaygr.errors import InvalidInput

MIB = 1 << 20
_COST_KEYS = ("fixed_ms", "per_token_ms", "per_pair_ms", "per_candidate_key_ms", "reload_ms_per_mb")
# What device memory holds besides the prefix caches, MiB (see `DeviceMemory`).
_RESIDENT_KEYS = ("runtime_mib", "weights_mib", "activations_mib", "other_mib")
_SECTIONS: dict[str, dict[str, type]] = {
    "": {"name": str, "description": str, "kind": str, "sources": list, "assumptions": list},
    # The fit's error and sample count are optional: a measured profile carries them, so that
    # writing it out and reading it back loses nothing; an assumed one has no fit. So is the
    # batch term (relaygr.cost.batch_ms): absent, a batch costs its requests' single calls.
    # `utilisation`: the achieved share of the device's peak the cost figures stand for. The
    # cached-rank terms are optional too: a measured profile has them; absent, 0 (not fitted).
    "cost": {
        **{k: float for k in _COST_KEYS},
        "median_abs_rel_error": float,
        "samples": int,
        "utilisation": float,
        "batch_saving_ms": float,
        "batch_samples": int,
        **{k: float for k in CACHED_TERMS},
    },
    # The device tier is either given (`device_tier_mib`) or sized from the device's memory
    # after what else it holds (`device_memory_mib` and the four shares after it).
    "memory": {
        "device_tier_mib": float,
        "host_tier_mib": float,
        "kv_bytes_per_token": int,
        **{k: float for k in ("device_memory_mib", *_RESIDENT_KEYS)},
    },
    "latency": {"request_overhead_ms": float, "compute_noise": float},
}
_REQUIRED = {
    "": ("name",),
    "cost": _COST_KEYS,
    "memory": ("host_tier_mib", "kv_bytes_per_token"),  # and a device tier, given or sized
}
KINDS = ("measured", "assumed")


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device's memory and what it holds besides the prefix caches, bytes: the runtime's
    context, the model's weights, the activation workspace of the forwards in flight, and
    anything else resident (an embedding cache, say). The rest is the device tier."""

    total: int
    runtime: int = 0
    weights: int = 0
    activations: int = 0
    other: int = 0

    @property
    def tier(self) -> int:
        """What is left for prefix caches."""
        return self.total - self.runtime - self.weights - self.activations - self.other


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One ranker as the simulator runs it.

    `cost` is both what the ranker predicts (its published cost model) and, spread by
    `compute_noise` (the relative standard deviation of a step's actual time), what a step
    takes. `request_overhead_ms` is a request's time outside compute: the client's and the
    router's network hops and (de)serialisation. `device_tier_bytes` is the prefix cache budget
    in device memory (HBM), `host_tier_bytes` the host (DRAM) tier; `memory`, when the profile
    sizes the device tier from the device's memory, says how (its `tier` is the device tier).
    `utilisation` is the achieved share of the device's peak compute the cost figures stand for
    (0: not stated, as for a measured profile); `at_utilisation` rescales them.
    """

    name: str
    cost: CostModel
    device_tier_bytes: int
    host_tier_bytes: int
    kv_bytes_per_token: int
    request_overhead_ms: float = 0.0
    compute_noise: float = 0.0
    kind: str = "assumed"
    description: str = ""
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()
    utilisation: float = 0.0
    memory: DeviceMemory | None = None

    def with_memory(self, device_tier_bytes: int) -> "DeviceProfile":
        """The same device with another prefix cache budget (sizing searches over it); the
        budget is then given, no longer sized from the device's memory."""
        return _replace(self, device_tier_bytes=device_tier_bytes, memory=None)

    def at_utilisation(self, utilisation: float) -> "DeviceProfile":
        """The same device achieving `utilisation` of its peak instead: the compute-bound cost
        terms (per token, per pair, per candidate key, and the cached rank's per row, key and
        row-key pair) scale by self.utilisation / utilisation; the per-call overheads
        (launches, dispatch) and the host link's reload rate do not."""
        if self.utilisation <= 0:
            raise InvalidInput(f"profile {self.name} states no utilisation to rescale from")
        if not 0 < utilisation <= 1:
            raise InvalidInput(f"utilisation must be in (0, 1], got {utilisation}")
        k = self.utilisation / utilisation
        c = self.cost
        cost = dataclasses.replace(
            c,
            per_token_ms=c.per_token_ms * k,
            per_pair_ms=c.per_pair_ms * k,
            per_candidate_key_ms=c.per_candidate_key_ms * k,
            cached_per_row_ms=c.cached_per_row_ms * k,
            cached_per_key_ms=c.cached_per_key_ms * k,
            cached_per_row_key_ms=c.cached_per_row_key_ms * k,
        )
        return _replace(self, cost=cost, utilisation=utilisation)


def _replace(profile: DeviceProfile, **changes: Any) -> DeviceProfile:
    values = {f.name: getattr(profile, f.name) for f in fields(profile)}
    values.update(changes)
    return DeviceProfile(**values)


def load_profile(path: Path) -> DeviceProfile:
    """Read a profile; InvalidInput names the file and line at fault."""
    try:
        text = path.read_text()
    except OSError as err:
        raise InvalidInput(f"{path}: cannot read the profile: {err.strerror}") from err
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        # Python 3.11's message ends "(at line N, column M)", or "(at end of document)" when
        # the text runs out (an unclosed array or string): that is the last line.
        found = re.search(r"\((?:at line (\d+), column \d+|at end of document)\)$", str(err))
        message = str(err) if found is None else str(err)[: found.start()].rstrip()
        if found is None:
            line = 1
        elif found.group(1) is None:
            line = max(1, len(text.splitlines()))
        else:
            line = int(found.group(1))
        raise InvalidInput(f"{path}:{line}: {message}") from err
    try:
        return _profile(raw)
    except _Bad as bad:
        raise InvalidInput(f"{path}:{_line_of(text, bad.section, bad.key)}: {bad}") from None


class _Bad(ValueError):
    def __init__(self, section: str, key: str, message: str) -> None:
        super().__init__(f"{f'[{section}] ' if section else ''}{key}: {message}")
        self.section, self.key = section, key


def _profile(raw: dict[str, Any]) -> DeviceProfile:
    tables: dict[str, dict[str, Any]] = {"": {}}
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in _SECTIONS or not key:
                raise _Bad("", key, f"unknown section; expected one of {sorted(_SECTIONS)[1:]}")
            tables[key] = value
        else:
            tables[""][key] = value
    for section, table in tables.items():
        for key, value in table.items():
            expected = _SECTIONS[section].get(key)
            if expected is None:
                known = ", ".join(_SECTIONS[section])
                raise _Bad(section, key, f"unknown key; expected one of {known}")
            _check(section, key, value, expected)
    sized: DeviceMemory | None = None
    for section, keys in _REQUIRED.items():
        if section == "memory":  # the device tier first: given, or sized from the memory
            sized = _device_memory(tables.get(section, {}))
        for key in keys:
            if key not in tables.get(section, {}):
                raise _Bad(section, key, "missing")
    top, cost, memory = tables[""], tables["cost"], tables["memory"]
    latency = tables.get("latency", {})
    kind = top.get("kind", "assumed")
    if kind not in KINDS:
        raise _Bad("", "kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    utilisation = float(cost.get("utilisation", 0.0))
    if utilisation > 1:
        raise _Bad("cost", "utilisation", f"must be in [0, 1], got {utilisation!r}")
    return DeviceProfile(
        name=top["name"],
        cost=CostModel(
            fixed_ms=float(cost["fixed_ms"]),
            per_token_ms=float(cost["per_token_ms"]),
            per_pair_ms=float(cost["per_pair_ms"]),
            per_candidate_key_ms=float(cost["per_candidate_key_ms"]),
            reload_ms_per_mb=float(cost["reload_ms_per_mb"]),
            median_abs_rel_error=float(cost.get("median_abs_rel_error", 0.0)),
            samples=cost.get("samples", 0),
            batch_saving_ms=float(cost.get("batch_saving_ms", 0.0)),
            batch_samples=cost.get("batch_samples", 0),
            **{k: float(cost.get(k, 0.0)) for k in CACHED_TERMS},
        ),
        device_tier_bytes=int(memory["device_tier_mib"] * MIB) if sized is None else sized.tier,
        host_tier_bytes=int(memory["host_tier_mib"] * MIB),
        kv_bytes_per_token=memory["kv_bytes_per_token"],
        request_overhead_ms=float(latency.get("request_overhead_ms", 0.0)),
        compute_noise=float(latency.get("compute_noise", 0.0)),
        kind=kind,
        description=top.get("description", ""),
        sources=tuple(top.get("sources", ())),
        assumptions=tuple(top.get("assumptions", ())),
        utilisation=utilisation,
        memory=sized,
    )


def _device_memory(memory: dict[str, Any]) -> DeviceMemory | None:
    """The device tier's sizing, when the profile sizes it (`device_memory_mib`); None when it
    gives `device_tier_mib`. Exactly one of the two."""
    given = "device_tier_mib" in memory
    if "device_memory_mib" not in memory:
        if not given:
            raise _Bad("memory", "device_tier_mib", "missing")
        extra = [k for k in _RESIDENT_KEYS if k in memory]
        if extra:
            raise _Bad("memory", extra[0], "needs device_memory_mib")
        return None
    if given:
        raise _Bad("memory", "device_tier_mib", "give it or device_memory_mib, not both")
    sized = DeviceMemory(
        int(memory["device_memory_mib"] * MIB),
        *(int(memory.get(k, 0.0) * MIB) for k in _RESIDENT_KEYS),
    )
    if sized.tier <= 0:
        raise _Bad("memory", "device_memory_mib", "leaves no room for a device tier")
    return sized


def _check(section: str, key: str, value: Any, expected: type) -> None:
    if expected is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _Bad(section, key, "must be a list of strings")
        return
    if expected is str:
        if not isinstance(value, str) or (key == "name" and not value):
            raise _Bad(section, key, f"must be a non-empty string, got {value!r}")
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if expected is int and not (isinstance(value, int) and not isinstance(value, bool)):
        raise _Bad(section, key, f"must be an integer, got {value!r}")
    if not number or not math.isfinite(value) or value < 0:
        raise _Bad(section, key, f"must be a finite number >= 0, got {value!r}")
    if key == "kv_bytes_per_token" and value == 0:
        raise _Bad(section, key, "must be positive")
    if key == "compute_noise" and value >= 1:
        raise _Bad(section, key, f"must be in [0, 1), got {value!r}")


_HEADER = re.compile(r"\[\[?\s*([^\]]*?)\s*\]\]?\s*(#.*)?")


def _line_of(text: str, section: str, key: str) -> int:
    """The line where `key` is set in `section` (its `key =` line, or the header of a table
    under it such as `[key]`, `[[key]]` or `[section.key]`); the section's header, or line 1,
    when the key is missing."""
    path = (section, key) if section else (key,)
    owner = (section,) if section else ()
    name = re.escape(key)
    sets_key = re.compile(rf"""(?:{name}|"{name}"|'{name}')\s*[=.]""")
    current: tuple[str, ...] = ()
    fallback = 1
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if (header := _HEADER.fullmatch(stripped)) is not None:
            current = tuple(p.strip().strip("\"'") for p in header.group(1).split("."))
            if current[: len(path)] == path:
                return number
            if section and current == owner:
                fallback = number
            continue
        if current == owner and sets_key.match(stripped):
            return number
    return fallback


def write_profile(profile: DeviceProfile, path: Path) -> None:
    """Write `profile` as a file `load_profile` reads back unchanged."""

    def strings(values: tuple[str, ...]) -> str:
        return "[\n" + "".join(f"  {_quote(v)},\n" for v in values) + "]"

    cost = profile.cost
    lines = [
        f"name = {_quote(profile.name)}",
        f"kind = {_quote(profile.kind)}",
        f"description = {_quote(profile.description)}",
        f"sources = {strings(profile.sources)}",
        f"assumptions = {strings(profile.assumptions)}",
        "",
        "[cost]  # milliseconds; see relaygr.cost.CostModel",
        *(f"{k} = {getattr(cost, k)!r}" for k in _COST_KEYS),
        f"median_abs_rel_error = {cost.median_abs_rel_error!r}",
        f"samples = {cost.samples}",
        f"utilisation = {profile.utilisation!r}",
        f"batch_saving_ms = {cost.batch_saving_ms!r}",
        f"batch_samples = {cost.batch_samples}",
        *(f"{k} = {getattr(cost, k)!r}" for k in CACHED_TERMS),
        "",
        "[memory]",
        *_device_tier_lines(profile),
        f"host_tier_mib = {profile.host_tier_bytes / MIB!r}",
        f"kv_bytes_per_token = {profile.kv_bytes_per_token}",
        "",
        "[latency]",
        f"request_overhead_ms = {profile.request_overhead_ms!r}",
        f"compute_noise = {profile.compute_noise!r}",
        "",
    ]
    path.write_text("\n".join(lines))


def _device_tier_lines(profile: DeviceProfile) -> list[str]:
    sized = profile.memory
    if sized is None:
        return [f"device_tier_mib = {profile.device_tier_bytes / MIB!r}"]
    shares = (sized.runtime, sized.weights, sized.activations, sized.other)
    return [
        f"device_memory_mib = {sized.total / MIB!r}",
        *(f"{k} = {v / MIB!r}" for k, v in zip(_RESIDENT_KEYS, shares, strict=True)),
    ]


def _quote(text: str) -> str:
    """A TOML basic string: backslash, quote and control characters (a newline in a
    description, say) escaped, as TOML requires."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\u{ord(m.group()):04x}", escaped) + '"'
