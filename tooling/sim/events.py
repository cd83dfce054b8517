"""The simulator's clock: a heap of timed callbacks, run in time order (ties in arrival order)."""

import gc
import heapq
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class EventLoop:
    """A virtual clock and the callbacks due on it.

    `now` only moves forward, to the time of the callback being run; a callback may schedule
    more, at `now` or later. Deterministic: equal times run in the order they were scheduled.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.ran = 0

    def clock(self) -> float:
        return self.now

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at `when` (a past time runs at `now`)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), fn, args))

    def after(self, delay_s: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay_s, fn, *args)

    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None) -> None:
        """Run callbacks in time order until none is left, or until the next is after `until`
        (then `now` is `until`)."""
        heap = self._heap
        while heap and (until is None or heap[0][0] <= until):
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            self.ran += 1
            fn(*args)
        if until is not None and until > self.now:
            self.now = until


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector paused for a simulation (resumed as it was after).

    A run allocates millions of objects and keeps most of them to its end (pending callbacks,
    caches, records), so each collector pass rescans a growing heap for cycles that the
    simulator's per-request objects do not form (`fleet._Forwarding`); with 100 rankers the
    passes took a seventh of a run. One full pass first, so that a run never holds an earlier
    run's garbage (a fleet is cyclic: its rankers and pending callbacks refer back to it) and
    peak memory stays that of one run; what a run leaves is collected after it.
    """
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
