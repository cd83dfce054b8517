"""A bounded search for the largest value that passes: by doubling and bisecting, assuming
passing is monotone (the relay benchmark's longest sequence, the simulator's, and `relaygr
loadgen`'s highest valid QPS), or by a scan up to the first miss (the simulated map's rates,
with `--search scan`)."""

from collections.abc import Callable


def grid_search(
    lo: int, hi: int, step: int, passes: Callable[[int], bool], floor: int | None = None
) -> tuple[int, list[int]]:
    """The largest multiple of `step` in [floor, hi] that passes, assuming passing is monotone:
    from `lo`, double until a miss (or, when `lo` misses, halve on the grid down to `floor`,
    default `lo`, until a pass), then bisect on the grid between the last pass and the first
    miss. Returns it (0 if nothing down to `floor` passes) and the values tried, in order."""
    tried: list[int] = []

    def test(value: int) -> bool:
        tried.append(value)
        return passes(value)

    floor = lo if floor is None else floor
    good: int | None = None
    bad: int | None = None
    if test(lo):
        good = lo
    else:
        bad = lo
    while good is None:  # halving down from a miss
        assert bad is not None
        lower = max(floor, (bad // 2 // step) * step)
        if lower >= bad:
            return 0, tried
        if test(lower):
            good = lower
        else:
            bad = lower
    while bad is None:  # doubling up from a pass
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


def scan_search(
    lo: int, hi: int, step: int, passes: Callable[[int], bool]
) -> tuple[int, list[int]]:
    """The largest multiple of `step` in [lo, hi] below which every value tried passes: `lo`,
    then each next multiple up to the first miss, which assumes nothing of the values above or
    below it (a P99 near the SLO is not monotone in the rate). Returns the last pass before
    the first miss (0 if `lo` misses) and the values tried, in order."""
    tried: list[int] = []
    good = 0
    for value in range(lo, hi + 1, step):
        tried.append(value)
        if not passes(value):
            break
        good = value
    return good, tried
