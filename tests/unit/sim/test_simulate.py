"""`relaygr simulate` as a user runs it: results written, bad files refused with file and line,
fleet changes applied, and one seed giving one result."""

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from relaygr.errors import InvalidInput
from tests.unit.sim.test_agreement import PROFILE
from tooling.local.workload import WorkloadSpec
from tooling.sim.fleet import FleetSettings
from tooling.sim.membership import FleetEvent
from tooling.sim.profile import write_profile
from tooling.sim.simulate import main
from tooling.sim.sweep import SweepSpec, run_sweep

SMALL = ["--rankers", "3", "--users", "5000", "--median-long-term", "120",
         "--max-long-term", "400", "--candidates", "32", "--slo-ms", "40",
         "--margin-ms", "10", "--gap-ms", "500", "--duration", "20"]  # fmt: skip


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    write_profile(PROFILE, path)
    return path


def seed() -> int:
    drawn = random.SystemRandom().randrange(2**32)
    print(f"seed {drawn}")
    return drawn


def test_a_run_writes_its_results_and_prints_them(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["--profile", str(profile), *SMALL, "--rates", "5", "10", "--seeds", str(seed())]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert {p["variant"] for p in data["points"]} == {
        "no cache", "cache only", "relay all", "relay sequence-aware"
    }  # fmt: skip
    assert {p["rate"] for p in data["points"]} == {5.0, 10.0}
    for point in data["points"]:
        assert point["sent"] > 0 and point["ok"] == point["sent"]
        assert point["p50_ms"] <= point["p99_ms"]
    assert data["command"].startswith("relaygr simulate --profile")
    printed = capsys.readouterr().out
    assert "SLO-compliant throughput" in printed
    assert (out / "results.md").read_text() in printed


def test_a_bad_profile_line_is_refused_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        'name = "bad"\n[cost]\nfixed_ms = 1.0\nper_token_ms = -0.5\nper_pair_ms = 0.0\n'
        "per_candidate_key_ms = 0.0\nreload_ms_per_mb = 0.1\n[memory]\n"
        "device_tier_mib = 1\nhost_tier_mib = 1\nkv_bytes_per_token = 8\n"
    )
    assert main(["--profile", str(path), "--out", str(tmp_path / "o"), "--seeds", "1"]) == 2
    assert f"{path}:4:" in capsys.readouterr().err


def test_a_bad_trace_line_is_refused_with_file_and_line(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"at": 0.0}\n')
    argv = ["--profile", str(profile), "--trace", str(trace), "--out", str(tmp_path / "o")]
    assert main([*argv, "--seeds", "1"]) == 2
    assert f"{trace}:1:" in capsys.readouterr().err


def sweep(seed: int, events: tuple[FleetEvent, ...] = ()) -> SweepSpec:
    workload = WorkloadSpec(
        users=5000, median_long_term=120, max_long_term=400, candidates=32, gap_s=0.5
    )
    return SweepSpec(
        PROFILE, FleetSettings(rankers=3, gap_s=0.5), workload, (10.0,), 30.0, (seed,),
        variants=("relay sequence-aware",), events=events,
    )  # fmt: skip


def test_a_killed_ranker_costs_hits_never_a_failed_rank() -> None:
    result = run_sweep(sweep(seed(), (FleetEvent.parse("10:kill:ranker-0"),)))
    (point,) = result.points
    assert point.point.ok == point.point.sent and not point.point.errors
    assert point.fleet["deregistrations"] == 1  # its lease lapsed
    assert point.point.hit_ratio > 0


def test_scale_out_and_rolling_restart_keep_every_rank_answered() -> None:
    events = tuple(
        FleetEvent.parse(e) for e in ("5:scale-out:2", "12:rolling-restart:2", "25:drain:ranker-1")
    )
    (point,) = run_sweep(sweep(seed(), events)).points
    assert point.point.ok == point.point.sent
    assert point.fleet["registrations"] == 3 + 2 + 5  # the 5 rankers live at 12 s, replaced


def test_a_sweep_s_points_are_the_same_whatever_the_points_run_at_once() -> None:
    # Two seeds, two rates, two variants: one at a time, or three at once in worker processes.
    spec = replace(
        sweep(seed()),
        rates=(8.0, 16.0),
        seeds=(seed(), seed()),
        variants=("relay all", "cache only"),
        duration_s=10.0,
    )
    one, three = run_sweep(spec), run_sweep(spec, jobs=3)
    order = lambda r: [(p.variant, p.point.rate, p.seed) for p in r.points]  # noqa: E731
    assert (
        order(one)
        == order(three)
        == [(v, rate, s) for s in spec.seeds for rate in spec.rates for v in spec.variants]
    )
    for a, b in zip(one.points, three.points, strict=True):
        assert (a.point, a.fleet, a.timeline) == (b.point, b.fleet, b.timeline)


@pytest.mark.parametrize("text", ["x:kill:ranker-0", "5:explode", "5:kill", "5:scale-out:0"])
def test_bad_fleet_events_are_refused(text: str) -> None:
    with pytest.raises(InvalidInput, match="fleet event"):
        FleetEvent.parse(text)
