"""A bounded search for the largest value that passes, assuming passing is monotone: the relay
benchmark's longest sequence, the simulator's, and `relaygr loadgen`'s highest valid QPS."""

from collections.abc import Callable


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
