"""Every rate asked for at a map point, the variants side by side (bench/sim_probe.py)."""

import argparse
import random

import pytest

from bench.sim_map import parse
from bench.sim_probe import first_failure, measure, probe_option, probes, render
from tooling.sim.sweep import VARIANTS


def probe_args(*argv: str) -> argparse.Namespace:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    args = parse(["--seed", str(seed), "--seeds", "1", "--no-docs", *argv], options=probe_option)
    args.duration, args.users, args.min_ranks = 2.0, 10_000, 30
    return args


def test_every_rate_and_variant_is_run_on_the_same_visits_and_rendered() -> None:
    args = probe_args("--probe", "nvidia-h100", "slo_ms=20", "40", "5")
    rows = measure(args)
    assert {(r["variant"], r["per_ranker"]) for r in rows} == {
        (v, rate) for v in VARIANTS for rate in (5.0, 40.0)
    }
    for rate in (5.0, 40.0):
        counted = {r["ranks"] for r in rows if r["per_ranker"] == rate}
        assert len(counted) == 1 and counted.pop() > 0  # the same visits for every variant
    for r in rows:
        assert r["low_ms"] <= r["p99_ms"] <= r["high_ms"]
        assert r["slo_ms"] == 20.0
        if r["p99_ms"] > r["slo_ms"]:
            assert not r["compliant"]
    machine = {"date": "today", "commit": "abc", "machine": "this one"}
    text = render({"rows": rows, "command": "sim_probe", "machine": machine})
    assert "**nvidia-h100, slo_ms=20, seed" in text
    assert text.count("\n| 5 | ") == 1 and text.count("\n| 40 | ") == 1
    assert "First failure from below: no cache" in text


def test_a_point_the_map_lacks_or_a_probe_without_rates_is_refused() -> None:
    with pytest.raises(SystemExit, match="no such point: slo_ms=25"):
        probes(probe_args("--probe", "nvidia-h100", "slo_ms=25", "10"))
    with pytest.raises(SystemExit, match="a profile, a point and rates"):
        probes(probe_args("--probe", "nvidia-h100", "centre"))
    with pytest.raises(SystemExit, match="at least one point"):
        probes(probe_args())


def test_the_first_failure_is_the_lowest_failing_rate_though_a_higher_one_passes() -> None:
    rows = [
        {"per_ranker": 60.0, "compliant": True},
        {"per_ranker": 62.5, "compliant": False},
        {"per_ranker": 65.0, "compliant": False},
        {"per_ranker": 70.0, "compliant": True},
    ]
    assert first_failure(rows) == 62.5
    assert first_failure(rows[:1]) is None
