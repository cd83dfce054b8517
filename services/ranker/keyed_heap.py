"""Keys ordered by a priority that can change: a binary heap with lazy deletion."""

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class KeyedHeap(Generic[K]):
    """Each key at most once, with a priority; the lowest priority comes first.

    `_current` holds each key's live heap item. Changing or removing a key leaves its old item
    in the heap, stale (no longer the key's live item); stale items are discarded when they
    reach the top, and the heap is rebuilt from `_current` once they outnumber the live ones,
    so the heap never holds more than about twice the keys and every operation costs
    O(log n), amortised. Equal priorities come out in the order they were set.
    """

    def __init__(self) -> None:
        self._current: dict[K, tuple[float, int, K]] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._order = itertools.count()  # tie-break: keys themselves are never compared

    def __len__(self) -> int:
        return len(self._current)

    def __contains__(self, key: K) -> bool:
        return key in self._current

    def set(self, key: K, priority: float) -> None:
        """Add `key`, or move it to `priority`."""
        item = (priority, next(self._order), key)
        self._current[key] = item
        heapq.heappush(self._heap, item)
        if len(self._heap) > 2 * len(self._current) + 32:
            self._heap = list(self._current.values())
            heapq.heapify(self._heap)

    def discard(self, key: K) -> None:
        self._current.pop(key, None)

    def first(self) -> K | None:
        """The key with the lowest priority, left in place; None when empty."""
        top = self._top()
        return None if top is None else top[2]

    def pop_due(self, limit: float) -> list[K]:
        """Remove and return every key whose priority is at most `limit`, lowest first."""
        due: list[K] = []
        while (top := self._top()) is not None and top[0] <= limit:
            heapq.heappop(self._heap)
            del self._current[top[2]]
            due.append(top[2])
        return due

    def _top(self) -> tuple[float, int, K] | None:
        heap = self._heap
        while heap and self._current.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)
        return heap[0] if heap else None
