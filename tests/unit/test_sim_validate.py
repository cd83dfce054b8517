"""The simulator's fidelity verdict (bench/sim_validate.py): the simulated P50, P90 and P99 of a
point judged against two real runs of the same trace."""

import dataclasses
import math

import numpy as np
import pytest

from bench.pipeline import Ran
from bench.sim_validate import (
    fidelity,
    fidelity_section,
    hit_slowdown,
    miss_slowdown,
    paired,
    paired_section,
)
from relaygr.cost import CostModel
from tests.unit.ranker.factories import prefix, rank_input
from tooling.local.drive import OK, Point, RequestRecord
from tooling.local.workload import Arrival


@pytest.mark.parametrize(
    ("runs", "sim", "within"),
    [
        ([1000.0, 2000.0], 1900.0, True),  # inside the runs' range, 27% above their mean
        ([1000.0, 2000.0], 2001.0, False),  # above the range and 33% above the mean
        ([1000.0, 1050.0], 1175.0, True),  # outside a narrow range, 14.6% above the mean
        ([1000.0, 1050.0], 1190.0, False),  # 16% above the mean
        ([1000.0, 1050.0], 870.0, False),  # 15.1% below the mean
        ([1000.0, math.inf], 1000.0, False),  # a run with no answered Rank decides nothing
    ],
)
def test_the_simulator_sits_in_the_real_runs_range_or_within_15_percent(
    runs: list[float], sim: float, within: bool
) -> None:
    assert fidelity(runs, sim)[2] is within


def test_spread_and_error_are_stated_against_the_runs() -> None:
    spread, error, _ = fidelity([1000.0, 1250.0], 900.0)
    assert spread == pytest.approx(0.25)
    assert error == pytest.approx(900 / 1125 - 1)


def point(latencies: list[float]) -> dict[str, object]:
    return dataclasses.asdict(Point("x", 0.5, ok=len(latencies), latencies_ms=latencies))


def test_the_section_counts_each_quantile_over_points_with_a_second_run() -> None:
    first = [float(v) for v in range(1, 101)]  # P50 50.5, P90 90.1, P99 99.01
    second = [v * 1.1 for v in first]
    sim_close = [v * 1.05 for v in first]  # inside the range at every quantile
    sim_far = [v * 2 for v in first]
    variant = {
        "points": [
            {"real": point(first), "sim": point(sim_close)},
            {"real": point(first), "sim": point(sim_far)},
            {"real": point(first), "sim": point(first)},  # no second run: not judged
        ],
        "again": [[point(second), point(second)]],
    }
    text = "\n".join(fidelity_section({"7": {"relay": variant}}))
    assert "P50 1 of 2" in text and "P90 1 of 2" in text and "P99 1 of 2" in text
    assert text.count("| 7 | relay |") == 2
    assert "+90% (no)" in text  # twice the first run, against the runs' mean 1.05


def test_each_twin_is_judged_on_its_own_and_a_result_without_it_has_no_section() -> None:
    """The twin given the served cost is judged against the same real runs as the calibrated
    one; a result saved before it existed renders only the calibrated verdict."""
    first = [float(v) for v in range(1, 101)]
    again = [[point([v * 1.1 for v in first])]]
    raw = {"real": point(first), "sim": point([v * 2 for v in first])}
    served = {**raw, "sim_served": point(first)}
    calibrated = "\n".join(fidelity_section({"7": {"relay": {"points": [served], "again": again}}}))
    learnt = "\n".join(
        fidelity_section({"7": {"relay": {"points": [served], "again": again}}}, "sim_served")
    )
    assert "P50 0 of 1" in calibrated and "P50 1 of 1" in learnt
    old = {"7": {"relay": {"points": [raw], "again": again}}}
    assert fidelity_section(old, "sim_served") == [] and fidelity_section(old) != []


def test_a_run_without_second_sweeps_has_no_fidelity_section() -> None:
    variant = {"points": [{"real": point([1.0]), "sim": point([1.0])}]}
    assert fidelity_section({"7": {"relay": variant}}) == []


def answered(latencies: list[float], sent: int | None = None) -> Point:
    n = len(latencies)
    return Point("x", 0.5, sent=n if sent is None else sent, ok=n, latencies_ms=latencies)


def test_two_runs_are_paired_rank_by_rank_only_when_every_rank_was_answered() -> None:
    """Each Rank's latency against the same arrival's: a twin twice as slow on every Rank is
    2x however the two runs' quantiles compare; a run with a Rank lost is not paired, as its
    i-th latency is no longer the i-th arrival's."""
    first = [10.0, 40.0, 20.0, 80.0, 30.0]
    ratio, r = paired(answered(first), answered([2 * v for v in first])) or (0.0, 0.0)
    assert ratio == pytest.approx(2.0) and r == pytest.approx(1.0)
    shuffled = [40.0, 10.0, 80.0, 20.0, 30.0]  # the same quantiles, other Ranks
    ratio, r = paired(answered(first), answered(shuffled)) or (0.0, 0.0)
    assert ratio == pytest.approx(1.0) and r < 0.0
    # each of six Ranks sent, a different one lost in each run: five latencies, not aligned
    assert paired(answered(first, sent=6), answered(shuffled, sent=6)) is None
    assert paired(answered(first), answered(first[:4])) is None


def test_the_rank_by_rank_table_pairs_each_twin_with_each_real_run() -> None:
    first = [float(v) for v in range(1, 101)]
    as_dict = dataclasses.asdict
    variant = {
        "points": [
            {"real": as_dict(answered(first)), "sim": as_dict(answered([v * 2 for v in first])),
             "sim_served": as_dict(answered([v * 1.1 for v in first]))},
            {"real": as_dict(answered(first)), "sim": as_dict(answered(first))},
        ],
        "again": [[as_dict(answered([v * 1.1 for v in first]))]],  # the first point's only
    }  # fmt: skip
    text = "\n".join(paired_section({"7": {"relay": variant}}))
    assert text.count("| 7 | relay |") == 1
    assert (
        "| 1.10x, r 1.00 | 2.00x, r 1.00 | 1.82x, r 1.00 | 1.10x, r 1.00 | 1.00x, r 1.00 |" in text
    )
    assert paired_section({"7": {"relay": {"points": variant["points"]}}}) == []


def test_time_in_the_ranker_is_read_against_the_call_each_outcome_is_served_as(
    rng: np.random.Generator,
) -> None:
    """Hits (device tier) are priced as one Rank on the cached prefix, misses as one full
    inference; warm-up Ranks, failures and other outcomes are left out; the simulated side's
    time in the ranker is its latency less the overhead given."""
    cost = CostModel(
        fixed_ms=5.0, per_token_ms=0.01, per_pair_ms=1e-5, per_candidate_key_ms=1e-4,
        reload_ms_per_mb=0.1, cached_fixed_ms=2.0, cached_per_row_ms=0.03,
        cached_per_row_key_ms=2e-5,
    )  # fmt: skip
    request = rank_input(rng, prefix(rng, 512), 16, 32)
    tokens = request.prefix.num_tokens
    hit = cost.rank_ms(tokens, 16, 32)
    full = cost.full_ms(tokens + 16, 32)
    assert hit < full / 2  # the two calls priced apart
    arrivals = [Arrival(at=0.1 if i == 0 else 1.0 + i, request=request) for i in range(5)]

    def record(i: int, outcome: str, ms: float, status: str = OK) -> RequestRecord:
        return RequestRecord(i, 0.0, ms / 1e3 + 0.004, status, outcome, server_ms=ms)

    records = [
        record(0, "hbm_hit", 100 * hit),  # in the warm-up: left out
        record(1, "hbm_hit", 2 * hit),
        record(2, "hbm_hit", 4 * hit),
        record(3, "miss", 3 * full),
        record(4, "dram_hit", 50 * hit),  # another outcome
        record(4, "hbm_hit", 100 * hit, status="DEADLINE_EXCEEDED"),
    ]
    ran = Ran("x", 1.0, arrivals, ([0.1] * 5, [True] * 5), 0.0, warmup_s=0.5)
    assert hit_slowdown(ran, records, cost, None) == [pytest.approx(3.0), 2]
    assert miss_slowdown(ran, records, cost, None) == [pytest.approx(3.0), 1]
    # Simulated: latency less the overhead (4 ms here) is the time in the ranker.
    assert hit_slowdown(ran, records, cost, 4.0) == [pytest.approx(3.0), 2]
    assert hit_slowdown(ran, records[3:4], cost, None) == []
