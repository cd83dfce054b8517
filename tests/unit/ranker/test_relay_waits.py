"""The relay-wait tail a ranker reports: the nearest-rank 99th percentile of the latest waits."""

import numpy as np
import pytest

from services.ranker.relay_waits import RelayWaits


def test_no_tail_is_reported_from_too_few_waits() -> None:
    waits = RelayWaits(kept=1024, least=100)
    for _ in range(99):
        waits.add(0.1)
    assert waits.p99_ms() == 0.0
    waits.add(0.1)
    assert waits.p99_ms() == pytest.approx(100.0)


def test_the_tail_is_the_nearest_rank_99th_percentile_of_the_latest_waits(
    rng: np.random.Generator,
) -> None:
    waits = RelayWaits(kept=200, least=100)
    for _ in range(300):
        waits.add(10.0)  # older than the 200 kept: forgotten
    drawn = rng.exponential(0.1, 200)
    for wait in drawn:
        waits.add(float(wait))
    assert len(waits) == 200
    assert waits.p99_ms() == pytest.approx(np.sort(drawn)[197] * 1e3)  # ceil(0.99 * 200) = 198th


def test_below_100_waits_the_tail_is_the_longest_from_20_on() -> None:
    waits = RelayWaits()
    for i in range(19):
        waits.add(i / 1000)
    assert waits.p99_ms() == 0.0
    waits.add(0.5)
    assert waits.p99_ms() == pytest.approx(500.0)
