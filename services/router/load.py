"""The load a router balances: PreInfers it placed on each ranker within the relay window."""

from collections import Counter, deque
from collections.abc import Callable


class WindowedLoad:
    """Counts placements per instance over the last `window_s` seconds of `clock`.

    A relay occupies its ranker (prefill work, a pinned cache) for about one relay window, so
    this is the work in flight that bounded-load placement spreads; unlike a count of open
    requests it does not swing with momentary concurrency.
    """

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, str]] = deque()
        self._counts: Counter[str] = Counter()

    def add(self, instance: str) -> None:
        self._events.append((self._clock(), instance))
        self._counts[instance] += 1

    def loads(self) -> Counter[str]:
        horizon = self._clock() - self._window_s
        while self._events and self._events[0][0] <= horizon:
            _, instance = self._events.popleft()
            self._counts[instance] -= 1
            if not self._counts[instance]:
                del self._counts[instance]
        return self._counts
