"""The relay benchmark's verdicts: grid search, compliant throughput over seeds, paired ratios."""

from dataclasses import dataclass, field

import pytest
from verdict import Spread, compliant_throughput, grid_search


@dataclass
class P:
    rate: float
    p99_ms: float
    errors: dict[str, int] = field(default_factory=dict)


@pytest.mark.parametrize("limit", [0, 512, 1024, 1536, 3072, 3584, 8192, 12288])
def test_grid_search_finds_the_largest_passing_multiple(limit: int) -> None:
    found, tried = grid_search(1024, 12288, 512, lambda n: n <= limit)
    assert found == (limit if limit >= 1024 else 0)
    assert all(n % 512 == 0 for n in tried)
    assert len(tried) == len(set(tried))  # no length is measured twice
    assert len(tried) <= 8  # doubling then bisecting, not a scan of 23 lengths


def test_compliant_throughput_is_the_rate_below_the_first_miss_per_seed() -> None:
    per_seed = {
        1: [P(1, 900), P(2, 1400), P(3, 1600), P(4, 1200)],  # 4 passes after a miss: noise
        2: [P(1, 800), P(2, 1000), P(3, 1100), P(4, 2000)],
        3: [P(1, 800), P(2, 900, {"UNAVAILABLE": 1}), P(3, 1000)],  # a failed Rank is a miss
    }
    spread = compliant_throughput(per_seed, 1500)
    assert (spread.median, spread.low, spread.high, spread.n) == (2, 1, 3, 3)
    assert spread.text(" req/s") == "2 req/s [1-3]"
    assert Spread.of([5.0]).text() == "5"


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 40])
def test_grid_search_halves_down_from_a_first_miss_to_its_floor(limit: int) -> None:
    found, tried = grid_search(8, 16, 1, lambda n: n <= limit, floor=1)
    assert found == min(limit, 16)
    assert tried[0] == 8 and len(tried) == len(set(tried))
    down: list[int] = []  # after a first miss: the halvings until one passes (or the floor)
    for half in (4, 2, 1) if limit < 8 else ():
        down.append(half)
        if half <= limit:
            break
    assert tried[1 : 1 + len(down)] == down
    assert len(tried) <= 6
