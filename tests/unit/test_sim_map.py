"""The simulated map (bench/sim_map.py): its grid, its ratios, and a tiny run end to end."""

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.pipeline import ROOT
from bench.sim_map import (
    AXES,
    CENTRE,
    CORNERS,
    chart,
    chosen,
    map_points,
    measure,
    parse,
    point_span,
    point_spec,
    ratios,
    render,
    search_variant,
    search_words,
    spread,
)
from tooling.sim.profile import load_profile
from tooling.sim.sweep import VARIANTS


def test_the_grid_is_one_axis_at_a_time_around_the_centre_plus_the_corners() -> None:
    points = map_points(AXES, CORNERS)
    assert points[0].label == "centre" and points[0].values == CENTRE
    others = sum(len([v for v in values if v != CENTRE[axis]]) for axis, values in AXES.items())
    assert len(points) == 1 + others + len(CORNERS)
    for point in points[1 : 1 + others]:  # exactly one value differs from the centre
        assert sum(point.values[k] != CENTRE[k] for k in CENTRE) == 1, point.label
    assert points[-1].values == {**CENTRE, **CORNERS[-1]}
    assert len({p.label for p in points}) == len(points)


def test_a_slow_point_runs_long_enough_to_count_the_ranks_its_p99_needs() -> None:
    args = parse(["--seed", "1", "--no-docs", "--profiles", "nvidia-h100"])
    base = load_profile(ROOT / "profiles" / "nvidia-h100.toml")
    spec = point_spec(args, base, CENTRE, 1)
    counted = 1 - spec.warmup
    # Fast enough: the point keeps --duration, and counts at least --min-ranks in it.
    fast = args.min_ranks / (spec.duration_s * counted)
    assert point_span(args, spec, fast * 2) == spec.duration_s
    # Slower: the span grows until --min-ranks are expected, no further.
    slow = fast / 4
    assert point_span(args, spec, slow) * slow * counted == pytest.approx(args.min_ranks)
    # A third of retrievals never rank: longer still, by the same count of Ranks.
    shows = point_spec(args, base, {**CENTRE, "no_show": 0.3}, 1)
    ranked = point_span(args, shows, slow) * slow * counted * 0.7
    assert ranked == pytest.approx(args.min_ranks)


def test_the_relay_window_is_the_services_default_unless_set_and_then_everyone_s() -> None:
    base = load_profile(ROOT / "profiles" / "nvidia-h100.toml")
    fleet = point_spec(parse(["--seed", "1", "--no-docs"]), base, CENTRE, 1).fleet
    assert fleet.trigger.relay_window_ms == 2000
    told = parse(["--seed", "1", "--no-docs", "--relay-window-ms", "500"])
    fleet = point_spec(told, base, CENTRE, 1).fleet
    windows = (fleet.trigger.relay_window_ms, fleet.router.relay_window_ms)
    assert (*windows, fleet.ranker.relay_window_ms) == (500, 500, 500)


@pytest.mark.parametrize(
    ("flag", "knob", "default", "given", "out_of_range"),
    [
        ("--no-show-prior", "no_show_prior", 1.0, "0", "1.5"),
        ("--relay-spare-share", "relay_spare_share", 1.0, "0", "1.5"),
        ("--relay-window-wait-factor", "relay_window_wait_factor", 0.0, "2", "-1"),
    ],
)
def test_each_trigger_knob_is_its_default_unless_set(
    flag: str, knob: str, default: float, given: str, out_of_range: str
) -> None:
    base = load_profile(ROOT / "profiles" / "nvidia-h100.toml")
    plain = point_spec(parse(["--seed", "1", "--no-docs"]), base, CENTRE, 1).fleet.trigger
    assert getattr(plain, knob) == default
    told = point_spec(parse(["--seed", "1", "--no-docs", flag, given]), base, CENTRE, 1)
    assert getattr(told.fleet.trigger, knob) == float(given)
    with pytest.raises(SystemExit):
        parse(["--seed", "1", flag, out_of_range])


def test_ratios_are_per_seed_over_the_best_baseline_and_infinite_when_it_never_complies() -> None:
    def row(value: float) -> dict[str, float]:
        return {"compliant_per_ranker": value}

    by = {
        "no cache": {1: row(10), 2: row(0), 3: row(0)},
        "cache only": {1: row(5), 2: row(0), 3: row(0)},
        "relay all": {1: row(20), 2: row(15), 3: row(0)},
        "relay sequence-aware": {1: row(30), 2: row(5), 3: row(0)},
    }
    # Seed 2: only the relay complies (inf); seed 3: neither does (no ratio).
    assert ratios(by, [1, 2, 3], "compliant_per_ranker") == [3.0, math.inf, None]
    assert spread([3.0, math.inf, None]) == "inf [3.00-inf] (1 seed: neither)"
    assert spread([0.5, 0.5]) == "0.50"
    assert spread([None, None]) == "neither"


def test_the_quick_path_runs_renders_and_charts_in_seconds(tmp_path: Path) -> None:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    args = parse(["--quick", "--seed", str(seed), "--no-docs"])
    args.duration, args.rate_max, args.length_max, args.users = 2.0, 20.0, 1024, 10_000
    results = measure(args)
    points = ["centre", "tier=binding"]
    assert results["points"] == points
    assert len(results["rows"]) == len(points) * 4  # one profile, one seed, four variants
    for row in results["rows"]:
        assert row["compliant_per_ranker"] % args.rate_step == 0
        assert row["longest"] % 512 == 0
        assert abs(sum(row["shares"].values()) - 1.0) < 1e-9  # relayed, cross-visit, full
    saved = {"command": "sim_map", "args": vars(args), **results}
    text = render(saved)
    assert "| centre |" in text and "| tier=binding |" in text
    assert "Where the relay does not pay" in text
    chart(saved, args.profiles[0], tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 0


def test_a_map_s_rows_are_the_same_whatever_the_points_run_at_once() -> None:
    # Each point x seed draws its own visits in its own worker: run two at once, the rows (and
    # their order) are those of one at a time.
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    rows = {}
    for jobs in (1, 2):
        args = parse(
            ["--quick", "--seed", str(seed), "--no-docs", "--seeds", "1", "--jobs", str(jobs)]
        )
        args.seeds, args.duration, args.rate_max, args.length_max = 2, 2.0, 10.0, 512
        args.users = 10_000
        rows[jobs] = measure(args)["rows"]
    assert [(r["point"], r["seed"], r["variant"]) for r in rows[1]] == [
        (p, seed + i, v) for p in ("centre", "tier=binding") for i in (0, 1) for v in VARIANTS
    ]
    assert rows[2] == rows[1]


def test_points_picks_the_labelled_points_and_refuses_a_label_no_point_has() -> None:
    points = map_points(AXES, CORNERS)
    wanted = ["tier=binding no_show=0.3", "centre"]
    picked = chosen(parse(["--points", *wanted]), points)
    assert [p.label for p in picked] == ["centre", "tier=binding no_show=0.3"]  # the map's order
    assert chosen(parse([]), points) == points
    with pytest.raises(SystemExit, match="no such point: tier=bind"):
        chosen(parse(["--points", "tier=bind"]), points)


@dataclass
class _Point:
    p99_ms: float

    def compliant(self, slo_ms: float) -> bool:
        return self.p99_ms <= slo_ms


@dataclass
class _Done:
    point: _Point

    def summary(self, slo_ms: float) -> dict[str, Any]:
        return {
            "p99_ms": self.point.p99_ms, "fleet": {"relays_refused": 0}, "reasons": {},
            "relayed_ratio": 0.0, "cached_ratio": 0.0, "hit_ratio": 0.0,
        }  # fmt: skip


@pytest.mark.parametrize(("search", "found"), [("bisect", 20.0), ("scan", 5.0)])
def test_a_scan_reports_the_rate_below_the_first_failure_where_bisection_lands_above_it(
    monkeypatch: pytest.MonkeyPatch, search: str, found: float
) -> None:
    """A P99 that fails at 7.5 req/s per ranker and passes above it (noise at the SLO's edge):
    bisection stops at a pass above the failure, the scan below it."""
    args = parse(["--seed", "1", "--no-docs", "--search", search])
    args.rate_max, args.length_max, args.users = 20.0, 1024, 10_000
    spec = point_spec(args, load_profile(ROOT / "profiles" / "nvidia-h100.toml"), CENTRE, 1)

    def run_point(spec: Any, variant: str, rate: float, *rest: Any) -> _Done:
        return _Done(_Point(100.0 if rate / args.rankers == 7.5 else 1.0))

    monkeypatch.setattr("bench.sim_map.run_point", run_point)
    row = search_variant(args, spec, "relay all", 1, lambda rate: [], lambda text: None)
    assert row["compliant_per_ranker"] == found
    assert ("scanned" in search_words(vars(args))) is (search == "scan")
