"""Compliant throughput from measured rate points: pure, so result renderers need no mesh."""

from collections.abc import Iterable
from typing import Protocol


class RatePoint(Protocol):
    """A measured point, read only (a frozen dataclass is one)."""

    @property
    def rate(self) -> float: ...
    @property
    def p99_ms(self) -> float: ...
    @property
    def errors(self) -> dict[str, int]: ...


def max_compliant(points: Iterable[RatePoint], slo_ms: float) -> float:
    """The highest rate below which every measured point met the SLO (P99, no failures)."""
    best = 0.0
    for point in sorted(points, key=lambda p: p.rate):
        if point.errors or point.p99_ms > slo_ms:
            break
        best = point.rate
    return best


def highest_compliant(points: Iterable[RatePoint], slo_ms: float) -> float:
    """The highest rate of any point that met the SLO (ignoring failures at lower rates)."""
    return max((p.rate for p in points if not p.errors and p.p99_ms <= slo_ms), default=0.0)
