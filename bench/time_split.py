"""Where a profiled call's time goes: the services' own code, the driver running it, libraries.

A function's own time (cProfile's `tottime`) counts for the floor its module stands on: the
services and the packages they share (`services/`, `relaygr/`), or the tooling that drives them
(`tooling/`, `bench/`). A function of neither (the standard library, numpy, a builtin) counts
for whoever called it, split by the time each caller's calls took; what such a function calls
in turn counts as the library's. The profiler's own cost per call falls on every floor alike,
so the shares are of the profiled run, an estimate of the unprofiled one.
"""

import cProfile
import pstats
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from bench.pipeline import ROOT

T = TypeVar("T")

SERVICES, DRIVER, LIBRARY = "services", "driver", "library"
FLOORS = {"services": SERVICES, "relaygr": SERVICES, "tooling": DRIVER, "bench": DRIVER}

# pstats' key for a function, and its row: calls, primitive calls, own time, cumulative time,
# and per caller the same four for that caller's calls
Key = tuple[str, int, str]
Row = tuple[int, int, float, float, Mapping[Key, tuple[int, int, float, float]]]


def floor_of(filename: str, root: Path = ROOT) -> str | None:
    """The floor a module's file stands on (None: outside the repository's code)."""
    try:
        top = Path(filename).resolve().relative_to(root).parts[0]
    except (ValueError, IndexError):
        return None
    return FLOORS.get(top)


def split(rows: Mapping[Key, Row], root: Path = ROOT) -> dict[str, float]:
    """Seconds of own time per floor (`SERVICES`, `DRIVER`, `LIBRARY`) over profiled `rows`."""
    seconds = {SERVICES: 0.0, DRIVER: 0.0, LIBRARY: 0.0}
    for (filename, _, _), (_, _, own, _, callers) in rows.items():
        floor = floor_of(filename, root)
        if floor is not None:
            seconds[floor] += own
            continue
        for (caller_file, _, _), (_, _, by_caller, _) in callers.items():
            seconds[floor_of(caller_file, root) or LIBRARY] += by_caller
    return seconds


def profiled(call: Callable[[], T]) -> tuple[T, dict[str, float], int]:
    """`call()` under cProfile: its result, seconds per floor, and the Python calls it made."""
    profile = cProfile.Profile()
    result = profile.runcall(call)
    rows: Any = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return result, split(rows), sum(row[1] for row in rows.values())
