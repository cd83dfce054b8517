"""Counts of observed values per bucket: a histogram a synchronous core keeps as plain data and a
metrics collector exports (`relaygr.metrics.histogram`), free of any metrics library."""

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BucketCounts:
    """Values observed so far: `counts[i]` of them were at most `bounds[i]` and above the bound
    before it; `counts[-1]` (one more than `bounds`) those above every bound. A value, so a
    snapshot is the object itself: `observed` returns a new one."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float = 0.0  # the sum of the values observed

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> "BucketCounts":
        assert list(bounds) == sorted(set(bounds)), "bounds must increase"
        return cls(bounds, (0,) * (len(bounds) + 1))

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observed(self, value: float) -> "BucketCounts":
        """These counts with `value` observed once more."""
        i = bisect.bisect_left(self.bounds, value)
        counts = (*self.counts[:i], self.counts[i] + 1, *self.counts[i + 1 :])
        return BucketCounts(self.bounds, counts, self.total + value)
