"""The at-risk relay demand by size that prices the trigger's relay room."""

import math

import pytest

from services.trigger.demand import CLASSES_PER_DOUBLING, RelayDemand, size_class


def test_size_classes_grow_with_size_in_quarter_doublings() -> None:
    assert size_class(1 << 20) == 20 * CLASSES_PER_DOUBLING
    assert size_class((1 << 20) + 1) == size_class(1 << 20)
    assert size_class(int((1 << 20) * 2**0.25) + 1) == size_class(1 << 20) + 1
    assert size_class(0) == size_class(1) == 0


def test_a_steady_flow_reads_as_its_rate_from_the_first_seconds() -> None:
    demand = RelayDemand(half_life_s=10.0)
    for i in range(30):  # 1,000 bytes every 100 ms: 10,000 bytes a second, for 3 s
        demand.add(1000, i / 10)
    assert demand.rate_below(2000, 2.95) == pytest.approx(10_000, rel=0.1)
    # Little's law: held 2 s each, 20,000 bytes at once.
    assert demand.held_below(2000, 2.0, 2.95) == pytest.approx(20_000, rel=0.1)


def test_only_smaller_size_classes_count() -> None:
    demand = RelayDemand(half_life_s=1e6)  # no decay to speak of
    demand.add(1000, 0.0)
    demand.add(100_000, 0.0)
    assert demand.rate_below(1000, 0.0) == 0.0  # its own class is first come, first served
    assert demand.rate_below(1200, 0.0) == pytest.approx(1000)  # over the 1 s least span
    assert demand.rate_below(10**9, 0.0) == pytest.approx(101_000)


def test_above_counts_only_larger_size_classes() -> None:
    demand = RelayDemand(half_life_s=1e6)
    demand.add(1000, 0.0)
    demand.add(100_000, 0.0)
    assert demand.rate_above(100_000, 0.0) == 0.0  # its own class is not above it
    assert demand.rate_above(1000, 0.0) == pytest.approx(100_000)
    assert demand.rate_above(0, 0.0) == pytest.approx(101_000)
    assert demand.held_above(1000, 2.0, 0.0) == pytest.approx(200_000)


def test_a_flow_that_stops_fades_by_half_lives() -> None:
    demand = RelayDemand(half_life_s=1.0)
    for i in range(100):
        demand.add(1000, i / 10)
    rate = demand.rate_below(2000, 10.0)
    assert demand.rate_below(2000, 13.0) == pytest.approx(rate / 8, rel=0.01)
    # Far later, the sums are brought back to now without losing a new flow.
    demand.add(1000, 500.0)
    assert demand.rate_below(2000, 500.0) == pytest.approx(1000 * math.log(2))
