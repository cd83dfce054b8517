"""`relaygr plan`: the search finds the exact least fleet and device tier, a fleet is sliced as
hashing would slice it, and the command answers with a size that meets the SLO where one ranker
fewer does not; bad input is refused with a message and exit code 2."""

import json
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from relaygr.placement import ranking
from tests.unit.sim.test_agreement import PROFILE
from tooling.local.workload import WorkloadSpec
from tooling.sim.fleet import FleetSettings
from tooling.sim.plan import (
    Goal,
    Run,
    Slice,
    confirm,
    fewest,
    host_estimate,
    least_below,
    search,
    slice_trace,
)
from tooling.sim.plan_cli import main
from tooling.sim.plan_report import Ask, SliceCheck, report, to_json
from tooling.sim.profile import write_profile
from tooling.sim.ranker import MemoryUse
from tooling.sim.sweep import SweepSpec
from tooling.sim.workload import Visit

SLO_MS = 100.0


def seed() -> int:
    drawn = random.SystemRandom().randrange(2**32)
    print(f"seed {drawn}")
    return drawn


NOTHING = MemoryUse()


def run(seed: int, meets: bool, memory: MemoryUse = NOTHING) -> Run:
    p99 = SLO_MS * (0.5 if meets else 2.0)
    return Run(seed, 1000, 0, p99 / 2, p99, 0.5, 0.25, memory, 60.0)


def from_(threshold: int) -> tuple[Callable[[int], bool], list[int]]:
    """A monotone test passing from `threshold` on, and the values it was asked, in order."""
    asked: list[int] = []

    def passes(value: int) -> bool:
        asked.append(value)
        return value >= threshold

    return passes, asked


@pytest.mark.parametrize("limit", [1, 2, 7, 64])
def test_fewest_finds_every_threshold_and_none_beyond_the_limit(limit: int) -> None:
    for threshold in range(1, limit + 2):
        passes, asked = from_(threshold)
        found = fewest(passes, limit)
        assert found == (threshold if threshold <= limit else None)
        assert len(asked) == len(set(asked)) and max(asked) <= limit
        assert len(asked) <= 2 * limit.bit_length() + 1


@pytest.mark.parametrize("above", [0, 1, 5, 9])
def test_fewest_above_a_known_failure_asks_nothing_at_or_below_it(above: int) -> None:
    limit = 40
    for threshold in range(above + 1, limit + 2):
        passes, asked = from_(threshold)
        assert fewest(passes, limit, above) == (threshold if threshold <= limit else None)
        assert min(asked) == above + 1 and max(asked) <= limit
        assert len(asked) == len(set(asked))
    assert fewest(lambda n: True, limit, above=limit) is None


@pytest.mark.parametrize("top", [1, 2, 9, 32])
def test_least_below_finds_every_threshold_without_asking_the_top(top: int) -> None:
    for threshold in range(1, top + 1):
        passes, asked = from_(threshold)
        assert least_below(passes, top) == threshold
        assert top not in asked and len(asked) == len(set(asked))


def test_search_finds_the_least_rankers_then_the_least_tier_over_every_seed() -> None:
    rng = random.Random(seed())
    step = 1 << 20
    top = rng.randrange(8, 200) * step + rng.randrange(step)  # not on the grid
    seeds = (rng.randrange(100), rng.randrange(100, 200))
    # Each seed needs its own fleet and, at the fleet's size, its own device tier.
    need = {s: rng.randrange(1, 300) for s in seeds}
    tier_need = {s: rng.randrange(1, top) for s in seeds}
    calls: list[tuple[int, int, int]] = []

    def evaluate(rankers: int, tier: int, s: int) -> Run:
        calls.append((rankers, tier, s))
        memory = MemoryUse(tier, tier // 4, rankers)
        return run(s, rankers >= need[s] and tier >= tier_need[s], memory)

    goal = Goal(SLO_MS, seeds, top, step, max_rankers=1000)
    plan = search(evaluate, goal)

    rankers = max(need.values())
    least_tier = min(-(-max(tier_need.values()) // step) * step, top)
    assert plan.rankers == rankers
    assert plan.answer is not None and plan.answer.device_tier_bytes == least_tier
    assert plan.answer.passed and len(plan.answer.runs) == len(seeds)
    assert plan.answer.memory == MemoryUse(least_tier, least_tier // 4, rankers)
    assert plan.at_top is not None and plan.at_top.device_tier_bytes == top
    if rankers > 1:
        assert plan.fewer is not None and not plan.fewer.passed
        assert plan.fewer.rankers == rankers - 1 and len(plan.fewer.runs) == len(seeds)
    else:
        assert plan.fewer is None
    assert len(calls) == len(set(calls)), "each (rankers, tier, seed) is simulated once"
    assert len(calls) < 2 * len(seeds) * (2 * 10 + 2 * top.bit_length())


@pytest.mark.parametrize("more", [0, 2])
def test_a_slice_answer_the_whole_fleet_misses_is_searched_again_with_whole_fleets(
    more: int,
) -> None:
    """Near capacity the slice errs low: here it passes from 5 rankers at a small tier, the
    whole fleet only from 5 + `more` rankers and a larger tier. The plan searches again with
    whole fleets from the slice's answer at the top tier, asking nothing below it."""
    rng = random.Random(seed())
    seeds, step, top = (1, 2, 3), 1 << 20, 64 << 20
    slice_need = 5
    whole_need, whole_tier = slice_need + more, rng.randrange(33, 64) * step
    goal = Goal(SLO_MS, seeds, top, step, max_rankers=100)
    sliced = search(lambda n, tier, s: run(s, n >= slice_need and tier > 8 * step), goal)
    assert sliced.answer is not None and sliced.answer.rankers == slice_need
    assert sliced.answer.device_tier_bytes < whole_tier
    asked: list[int] = []

    def whole(rankers: int, tier: int, s: int) -> Run:
        asked.append(rankers)
        return run(s, rankers >= whole_need and tier >= whole_tier)

    at_answer = [whole(slice_need, sliced.answer.device_tier_bytes, s) for s in seeds]
    asked.clear()
    plan = confirm(sliced, at_answer, whole)
    assert plan is not None and plan.answer is not None
    assert (plan.answer.rankers, plan.answer.device_tier_bytes) == (whole_need, whole_tier)
    assert plan.fewer is not None and plan.fewer.rankers == whole_need - 1
    assert not plan.fewer.passed
    assert min(r for r in asked if r != whole_need - 1) == slice_need
    # Where the whole fleet meets the SLO at the slice's answer, the sliced plan stands.
    assert confirm(sliced, [run(s, True) for s in seeds], whole) is None


def test_the_search_again_does_not_simulate_again_the_whole_fleet_at_the_slice_s_answer() -> None:
    # The slice passes from 5 rankers, and only at the top tier; the whole fleet needs 7. The
    # search again starts at 5 rankers and the top tier: the check already ran it, whole.
    seeds, step, top = (1, 2, 3), 1 << 20, 64 << 20
    goal = Goal(SLO_MS, seeds, top, step, max_rankers=100)
    sliced = search(lambda n, tier, s: run(s, n >= 5 and tier == top), goal)
    assert sliced.answer is not None
    assert (sliced.answer.rankers, sliced.answer.device_tier_bytes) == (5, top)
    asked: list[tuple[int, int, int]] = []

    def whole(rankers: int, tier: int, s: int) -> Run:
        asked.append((rankers, tier, s))
        return run(s, rankers >= 7)

    at_answer = [whole(5, top, s) for s in seeds]
    asked.clear()
    plan = confirm(sliced, at_answer, whole)
    assert plan is not None and plan.answer is not None and plan.answer.rankers == 7
    assert not [a for a in asked if a[:2] == (5, top)], asked
    assert plan.steps[0].rankers == 5 and not plan.steps[0].passed  # judged from the check's runs


def test_a_plan_searched_again_whole_prints_and_saves_the_whole_fleet_s_answer() -> None:
    seeds, step, top = (1, 2), 1 << 20, 64 << 20
    goal = Goal(SLO_MS, seeds, top, step, max_rankers=100)
    sliced = search(lambda n, tier, s: run(s, n >= 5), goal)
    assert sliced.answer is not None

    def whole(rankers: int, tier: int, s: int) -> Run:
        return run(s, rankers >= 7)

    at_answer = [whole(5, sliced.answer.device_tier_bytes, s) for s in seeds]
    plan = confirm(sliced, at_answer, whole)
    assert plan is not None
    spec = SweepSpec(PROFILE, FleetSettings(), WorkloadSpec(users=1000), (10.0,), 30.0, seeds)
    ask = Ask("relaygr plan ...", 10.0, SLO_MS, "relay all", 4, 100, 100, 1, "p.toml", None, spec)
    check = [SliceCheck(r, w) for r, w in zip(sliced.answer.runs, at_answer, strict=True)]
    text = report(plan, ask, check, sliced)
    assert "Answer: 7 rankers" in text
    assert "Simulated whole: the slice's answer, 5 rankers" in text
    assert "Searched (slices): " in text and "Then whole: 5x64 MiB fail, 6x64 MiB fail" in text
    assert "the search above ran again with whole fleets" in text
    saved = to_json(plan, ask, check, sliced)
    assert saved["answer"]["rankers"] == 7 and saved["sliced"]["answer"]["rankers"] == 5
    assert to_json(sliced, ask, [], None)["sliced"] is None


def test_search_says_so_when_no_fleet_is_enough() -> None:
    goal = Goal(SLO_MS, (1, 2), 64, 8, max_rankers=20)
    plan = search(lambda n, tier, s: run(s, False), goal)
    assert plan.rankers is None and plan.answer is None
    assert plan.fewer is not None and plan.fewer.rankers == 20
    assert [t.rankers for t in plan.steps] == [1, 2, 4, 8, 16, 20]


def test_a_run_with_a_failed_rank_does_not_pass() -> None:
    assert not replace(run(1, True), failed=1).meets(SLO_MS)
    assert run(1, True).meets(SLO_MS) and not run(1, False).meets(SLO_MS)


def test_a_slice_has_its_share_of_rate_and_users() -> None:
    part = Slice.of(16, 4)
    assert (part.rankers, part.fleet) == (4, 16)
    assert part.rate(1000.0) == 250.0 and part.users(1_000_000) == 250_000
    assert Slice.of(3, 8) == Slice(3, 3) and Slice.of(3, 8).rate(10.0) == 10.0
    assert Slice.of(10_000, 1).users(10) == 1


def test_a_trace_slice_keeps_the_users_the_slice_owns_at_the_target_rate() -> None:
    rng = random.Random(seed())
    visits = [
        Visit(t * 0.5, f"u{rng.randrange(300)}", 4, rng.randrange(10, 100), 8, 16)
        for t in range(2000)
    ]
    qps = 100.0
    whole = slice_trace(visits, qps, Slice.of(5, 8))
    assert len(whole) == len(visits)
    assert whole[-1].at == pytest.approx(len(visits) / qps)
    part = Slice.of(16, 4)
    kept = slice_trace(visits, qps, part)
    names = [f"ranker-{i}" for i in range(16)]
    owners = {v.user: ranking(v.user, names)[0] for v in visits}
    expected = [v for v in visits if owners[v.user] in names[:4]]
    assert [(v.user, v.behaviours) for v in kept] == [(v.user, v.behaviours) for v in expected]
    assert 0.1 < len(kept) / len(visits) < 0.4  # about a quarter


def test_host_use_is_scaled_to_the_tiers_ttl_when_the_run_was_shorter() -> None:
    assert host_estimate(1000, 60.0, 300.0) == 5000
    assert host_estimate(1000, 600.0, 300.0) == 1000


# -- the command ------------------------------------------------------------------------------

# The agreement test's device with room for relays: full inference of the longest history
# (~570 tokens) takes ~170 ms, so a 250 ms SLO is met at low load and missed when queues form.
TINY = replace(
    PROFILE,
    name="tiny",
    device_tier_bytes=4000 * PROFILE.kv_bytes_per_token,
    host_tier_bytes=20000 * PROFILE.kv_bytes_per_token,
)
SMALL = ["--users", "2000", "--median-long-term", "120", "--max-long-term", "400",
         "--candidates", "32", "--slo-ms", "250", "--margin-ms", "100", "--gap-ms", "500",
         "--duration", "20", "--min-ranks", "400", "--qps", "30"]  # fmt: skip


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    write_profile(TINY, path)
    return path


def test_plan_answers_with_the_fewest_rankers_that_meet_the_slo(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    argv = ["--profile", str(profile), *SMALL, "--seeds", str(seed()), str(seed())]
    extra = ["--memory-step-mib", "0.5", "--slice", "4", "--check-slice", "--json", str(out)]
    assert main([*argv, *extra]) == 0
    data = json.loads(out.read_text())
    rows = {row["label"]: row for row in data["rows"]}
    answer = data["answer"]
    assert answer["rankers"] > 1, "the load needs more than one ranker"
    assert 0 < answer["device_tier_bytes"] <= TINY.device_tier_bytes
    assert 0 <= answer["host_bytes"] <= TINY.host_tier_bytes
    met = rows["answer"]["runs"]
    assert len(met) == 2 and all(r["failed"] == 0 and r["p99_ms"] <= 250 for r in met)
    assert all(0 < r["memory"]["device_bytes"] <= answer["device_tier_bytes"] for r in met)
    fewer = rows["one ranker fewer"]
    assert fewer["rankers"] == answer["rankers"] - 1 and not fewer["passed"]
    assert any(r["failed"] or r["p99_ms"] > 250 for r in fewer["runs"])
    if answer["rankers"] > 4:  # the whole fleet was simulated beside its slice of 4
        assert [c["whole"]["seed"] for c in data["slice_check"]] == [r["seed"] for r in met]
    printed = capsys.readouterr().out
    assert f"Answer: {answer['rankers']} rankers" in printed
    assert "Slice: N rankers" in printed and "Not simulated" in printed
    assert data["command"].startswith("relaygr plan --profile") and "--seeds" in printed
    # A result file: the machine and commit stamped as the run started, the report it printed.
    assert {"date", "commit", "machine", "threads"} <= set(data["machine"])
    assert data["report"] in printed


def test_a_plan_is_the_same_whatever_the_simulations_run_at_once(
    profile: Path, tmp_path: Path
) -> None:
    # Three seeds: one at a time, or all three at once in worker processes, where a trial's
    # seeds after its first failing one ran too but must not count.
    seeds = [str(seed()) for _ in range(3)]
    saved = {}
    for jobs in ("1", "3"):
        out = tmp_path / f"plan-{jobs}.json"
        argv = ["--profile", str(profile), *SMALL, "--seeds", *seeds, "--slice", "4",
                "--memory-step-mib", "0.5", "--check-slice", "--jobs", jobs,
                "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        saved[jobs] = json.loads(out.read_text())
    for key in ("answer", "rows", "steps", "slice_check", "sliced"):
        assert saved["1"][key] == saved["3"][key], key


def test_no_profile_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SMALL) == 2
    assert "give one of --profile FILE or --profile-from" in capsys.readouterr().err


def test_a_bad_profile_line_is_refused_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('name = "bad"\n[cost]\nfixed_ms = "one"\n')
    assert main(["--profile", str(path), *SMALL]) == 2
    assert f"{path}:3:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value"), [("--qps", "0"), ("--qps", "-5"), ("--slo-ms", "0"), ("--slo-ms", "-1")]
)
def test_a_rate_or_slo_not_above_zero_is_refused(
    profile: Path, option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--profile", str(profile), *SMALL, option, value])
    assert exited.value.code == 2
    assert f"argument {option}: must be > 0" in capsys.readouterr().err


def test_an_slo_within_the_margin_is_refused(
    profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--profile", str(profile), *SMALL, "--slo-ms", "50"]) == 2
    assert "margin_ms" in capsys.readouterr().err
