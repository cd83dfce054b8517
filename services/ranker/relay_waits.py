"""How long relays waited for their Rank on this ranker: the tail a relay window must cover.

Pure: waits are passed in, in seconds. The ranker reports the tail in Describe
(`RankerInfo.relay_wait_p99_ms`); a trigger with `relay_window_wait_factor` set asks for
relay windows that many times it (docs/architecture.md, "Relay windows").
"""

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

# The waits kept: the latest this many, so the tail follows a gap that changes.
KEPT = 1024
# Fewer waits than this say too little of the tail: none is reported. Below 100 waits the
# nearest-rank 99th percentile is the longest of them, about the 95th percentile of 20: twice
# that still covers a log-normal gap of sigma 0.5 past its 99.9th percentile. Where the room
# binds few relays are consumed (a simulated 6 s point ranked ~100 per ranker), so a threshold
# of 100 would leave the windows at their longest exactly where they cost the most.
LEAST = 20


@dataclass(slots=True)
class RelayWaits:
    """The waits of the latest `kept` relays whose Rank came: from the relay's pin to its Rank's
    arrival, a Rank that came after the pin ended included (while its prefix was still held:
    `KVStore.rank_arrived`). Kept in arrival order and in sorted order, so that reading the
    tail (every Describe, scrape and simulated observation) costs no sort: an add costs a
    bisection and a shift of at most `kept` floats."""

    kept: int = KEPT
    least: int = LEAST
    _waits: deque[float] = field(default_factory=deque)  # in arrival order
    _sorted: list[float] = field(default_factory=list)

    def add(self, wait_s: float) -> None:
        if len(self._waits) == self.kept:
            oldest = self._waits.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        wait_s = max(wait_s, 0.0)
        self._waits.append(wait_s)
        bisect.insort(self._sorted, wait_s)

    def __len__(self) -> int:
        return len(self._waits)

    def p99_ms(self) -> float:
        """The 99th percentile of the waits kept, ms (nearest rank: below 100 waits, the
        longest); 0 while fewer than `least` are kept (unknown)."""
        n = len(self._sorted)
        if n < self.least:
            return 0.0
        return self._sorted[math.ceil(0.99 * n) - 1] * 1e3
