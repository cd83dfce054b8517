"""Verdicts over repeated runs: compliant throughput per SLO, longest sequence, median and spread.

Pure: takes measured points (anything with rate, p99 and errors), returns numbers. The relay
benchmark and its tests use it; nothing here starts a process.
"""

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from report import RatePoint, max_compliant


@dataclass(frozen=True, slots=True)
class Spread:
    """The median of a figure over seeds, and its range."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not values:
            return cls(0.0, 0.0, 0.0, 0)
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, unit: str = "") -> str:
        if self.n <= 1 or self.low == self.high:
            return f"{self.median:g}{unit}"
        return f"{self.median:g}{unit} [{self.low:g}-{self.high:g}]"


def compliant_throughput(per_seed: Mapping[int, Iterable[RatePoint]], slo_ms: float) -> Spread:
    """Over seeds: the highest rate below which every point met `slo_ms` (P99, no failure)."""
    return Spread.of([max_compliant(list(points), slo_ms) for points in per_seed.values()])


def grid_search(
    lo: int, hi: int, step: int, passes: Callable[[int], bool]
) -> tuple[int, list[int]]:
    """The largest multiple of `step` in [lo, hi] that passes, assuming passing is monotone:
    double from `lo` until a miss, then bisect on the grid. Returns it (0 if `lo` misses) and
    the lengths tried, in order."""
    tried: list[int] = []

    def test(length: int) -> bool:
        tried.append(length)
        return passes(length)

    if not test(lo):
        return 0, tried
    good, bad = lo, None
    while bad is None:
        nxt = min(good * 2, hi)
        if nxt <= good:
            return good, tried
        if test(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > step:
        mid = good + ((bad - good) // (2 * step)) * step
        mid = max(mid, good + step)
        if test(mid):
            good = mid
        else:
            bad = mid
    return good, tried
