"""The benchmarks' verdicts: grid search, compliant throughput over seeds, paired ratios, bootstrap
intervals, and the wording of a P99 verdict on too few Ranks or seeds."""

import argparse
from dataclasses import dataclass, field

import numpy as np
import pytest

from bench.verdict import (
    MIN_RANKS,
    MIN_SIM_SEEDS,
    PairedRatios,
    Spread,
    add_seeds_rule,
    check_seeds,
    compliant_throughput,
    grid_search,
    p99_ci,
    p99_interval,
    p99_verdict,
    ranks_note,
    scan_search,
    seeds_note,
    verdict_word,
)


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


def test_scan_search_stops_below_the_first_miss_where_bisection_lands_above_it() -> None:
    passing = {1, 2, 3, 4, 5, 6, 8, 9, 10}  # 7 misses, 8-10 pass again (a P99 at the SLO's edge)
    assert scan_search(1, 16, 1, passing.__contains__) == (6, [1, 2, 3, 4, 5, 6, 7])
    assert grid_search(1, 16, 1, passing.__contains__)[0] == 10  # a pass above the miss
    assert scan_search(1, 16, 1, lambda n: False) == (0, [1])
    assert scan_search(2, 8, 2, lambda n: True) == (8, [2, 4, 6, 8])


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


def test_bootstrap_p99_interval_is_seeded_and_brackets_the_p99() -> None:
    seed = 20261204
    print(f"seed {seed}")
    latencies = list(np.random.default_rng(seed).lognormal(6.5, 0.4, 400))
    first, again = p99_interval(latencies), p99_interval(latencies)
    assert first == again  # the same file renders the same interval
    assert first.n == 400
    assert first.low <= first.value <= first.high
    assert first.value == pytest.approx(np.percentile(latencies, 99))
    assert first.high - first.low > 0  # a P99 over 400 samples is not exact
    assert "95% CI, n=400" in first.text(" ms")


def test_a_p99_verdict_under_300_ranks_is_indicative_never_pass_or_fail() -> None:
    assert verdict_word(True, 299) == "indicative (n=299)"
    assert verdict_word(False, 42) == "indicative (n=42)"
    assert verdict_word(True, MIN_RANKS) == "pass"
    assert verdict_word(False, 300) == "fail"
    assert verdict_word(True, 2, MIN_SIM_SEEDS, unit="seeds") == "indicative (seeds=2)"
    few, many = [100.0] * 60, [100.0] * 299 + [2000.0] * 10
    assert p99_verdict(few, 1500).startswith("indicative (n=60): P99 100 ms [100-100 ms")
    assert p99_verdict(many, 1500).startswith("fail: P99 2000 ms")
    assert p99_verdict([100.0] * 300, 1500).startswith("pass: P99 100 ms")


def test_notes_label_figures_resting_on_too_few_ranks_or_seeds() -> None:
    assert ranks_note([28, 60, 41]) == "indicative (n=28-60 Ranks a point, under 300)"
    assert ranks_note([30]) == "indicative (n=30 Ranks a point, under 300)"
    assert ranks_note([300, 412]) == ""
    assert seeds_note(2) == "indicative (seeds=2, under 5)"
    assert seeds_note(5) == ""


def test_paired_ratios_divide_per_seed_and_bound_the_median() -> None:
    relay = {1: 3.0, 2: 4.0, 3: 6.0, 4: 2.0}
    base = {1: 2.0, 2: 2.0, 3: 1.0, 4: 0.0}  # seed 4: the baseline never complied
    paired = PairedRatios.of(relay, base)
    assert paired.ratios == {1: 1.5, 2: 2.0, 3: 6.0}
    assert (paired.low, paired.high, paired.undefined) == (1.5, 6.0, 1)
    assert paired.median.value == 2.0 and paired.median.n == 3
    assert paired.median.low >= 1.5 and paired.median.high <= 6.0
    assert paired.text().startswith("2x (per seed 1.5-6x; median's 95% CI ")
    assert PairedRatios.of({1: 1.0}, {1: 0.0}).text() == "-"


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["--seeds", "2"], True),
        (["--seeds", "5"], False),
        (["--seeds", "2", "--indicative"], False),
        (["--seeds", "2", "--quick"], False),
        (["--seeds", "2", "--from-json", "x.json"], False),
    ],
)
def test_a_simulated_comparison_on_fewer_than_5_seeds_is_refused_unless_indicative(
    argv: list[str], refused: bool
) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--from-json")
    add_seeds_rule(parser)
    args = parser.parse_args(argv)
    if refused:
        with pytest.raises(SystemExit):
            check_seeds(parser, args, args.seeds)
    else:
        check_seeds(parser, args, args.seeds)


def test_sim_paper_refuses_two_seeds() -> None:
    import bench.sim_paper as sim_paper

    with pytest.raises(SystemExit):
        sim_paper.parse(["--seeds", "2"])
    assert sim_paper.parse(["--seeds", "2", "--indicative"]).seeds == 2
    assert sim_paper.parse([]).seeds == MIN_SIM_SEEDS


def test_a_p99_cell_shows_its_interval_or_a_dash_without_latencies() -> None:
    assert p99_ci([]) == "-"
    interval = p99_interval([float(v) for v in range(1, 401)])
    assert p99_ci([float(v) for v in range(1, 401)]) == f"{interval.low:.0f}-{interval.high:.0f}"
