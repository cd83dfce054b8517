"""Verdicts over repeated runs: compliant throughput per SLO, longest sequence, median and spread.

Pure: takes measured points (anything with rate, p99 and errors), returns numbers. The relay
benchmark and its tests use it; nothing here starts a process.
"""

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from report import RatePoint, max_compliant

from relaygr.local.search import grid_search

__all__ = ["Spread", "compliant_throughput", "grid_search"]


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
