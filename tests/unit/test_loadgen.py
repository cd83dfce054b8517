"""`relaygr loadgen`'s pure parts: LoadGen's verdict read from its own logs (a real LoadGen run
against an in-process SUT), what counts as valid, the mode check, the visits of a test."""

import subprocess
import sys
from pathlib import Path

import mlperf_loadgen as lg
import pytest

from services.ranker.model_config import ModelPreset
from tooling.local.drive import Point
from tooling.local.loadgen import Settings, check_mode, is_valid, visits
from tooling.local.loadgen_sut import (
    DETAIL_LOG,
    SUMMARY_LOG,
    Verdict,
    import_loadgen,
    read_detail_log,
    verdict_of,
)
from tooling.local.modes import CACHE_ONLY, NO_CACHE, RELAY_ALL


def loadgen_run(outdir: Path, target_latency_ns: int) -> int:
    """A short Server-scenario test of a SUT that answers every query at once (P90 target, so
    early stopping can pass on ~100 queries); returns how many queries were issued."""
    issued = []

    def issue(samples: list[lg.QuerySample]) -> None:
        issued.extend(samples)
        lg.QuerySamplesComplete([lg.QuerySampleResponse(s.id, 0, 0) for s in samples])

    settings = lg.TestSettings()
    settings.scenario = lg.TestScenario.Server
    settings.mode = lg.TestMode.PerformanceOnly
    settings.server_target_qps = 400.0
    settings.server_target_latency_ns = target_latency_ns
    settings.server_target_latency_percentile = 0.9
    settings.min_duration_ms = 500
    settings.min_query_count = 150
    logs = lg.LogSettings()
    logs.log_output.outdir = str(outdir)
    logs.log_output.copy_summary_to_stdout = False
    sut = lg.ConstructSUT(issue, lambda: None)
    qsl = lg.ConstructQSL(16, 16, lambda _: None, lambda _: None)
    try:
        lg.StartTestWithLogSettings(sut, qsl, settings, logs)
    finally:
        lg.DestroyQSL(qsl)
        lg.DestroySUT(sut)
    return len(issued)


def summary_result(outdir: Path) -> str:
    """The "Result is : X" of LoadGen's human summary."""
    for line in (outdir / SUMMARY_LOG).read_text().splitlines():
        if line.startswith("Result is"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no result line in the summary")


def test_a_valid_verdict_is_read_from_loadgen_s_detail_log(tmp_path: Path) -> None:
    issued = loadgen_run(tmp_path, target_latency_ns=50_000_000)  # 50 ms: instant answers pass
    verdict = verdict_of(read_detail_log(tmp_path / DETAIL_LOG))
    assert verdict.validity == summary_result(tmp_path) == "VALID", verdict
    assert verdict.valid and verdict.early_stopping_met and verdict.perf_constraints_met
    assert verdict.queries == issued >= 150
    assert verdict.overlatency == 0 and verdict.percentile == 0.9
    assert 0 < verdict.latency_ms <= verdict.p99_ms < 50
    assert verdict.early_stopping and verdict.loadgen_version.startswith("6.0.17")


def test_an_invalid_verdict_says_which_constraint_failed(tmp_path: Path) -> None:
    loadgen_run(tmp_path, target_latency_ns=1)  # nothing answers within 1 ns
    verdict = verdict_of(read_detail_log(tmp_path / DETAIL_LOG))
    assert verdict.validity == summary_result(tmp_path) == "INVALID"
    assert not verdict.perf_constraints_met and not verdict.early_stopping_met
    assert verdict.overlatency == verdict.queries
    assert "not met: latency, early stopping" in verdict.text()


def test_a_detail_log_without_a_result_is_refused(tmp_path: Path) -> None:
    log = tmp_path / DETAIL_LOG
    log.write_text(':::MLLOG {"key": "loadgen_version", "value": "6.0.17"}\n')
    with pytest.raises(ValueError, match="holds no result"):
        verdict_of(read_detail_log(log))


def verdict(valid: bool) -> Verdict:
    return Verdict(
        "VALID" if valid else "INVALID", valid, True, True, valid, "", 10.0, 10.0, 0.99,
        100.0, 100.0, 500, 0, "6.0.17",
    )  # fmt: skip


def point(outcomes: dict[str, int], errors: dict[str, int] | None = None) -> Point:
    return Point(
        "p", 1.0, ok=sum(outcomes.values()), outcomes=outcomes, errors=errors or {}, sent=1
    )


def test_a_test_is_valid_only_when_loadgen_says_so_and_no_rank_failed() -> None:
    assert is_valid(verdict(True), point({"miss": 3}))
    assert not is_valid(verdict(False), point({"miss": 3}))
    # LoadGen counts a failed query as answered: a failed Rank makes the test not valid.
    assert not is_valid(verdict(True), point({"miss": 3}, {"UNAVAILABLE": 1}))


def test_a_mesh_not_in_the_system_s_mode_is_refused() -> None:
    check_mode(NO_CACHE, point({"bypass": 4}))
    check_mode(CACHE_ONLY, point({"miss": 2, "hbm_hit": 2}))
    with pytest.raises(SystemExit, match="should bypass every cache"):
        check_mode(NO_CACHE, point({"bypass": 3, "miss": 1}))
    with pytest.raises(SystemExit, match="should keep caches"):
        check_mode(RELAY_ALL, point({"bypass": 4}))


def settings(seed: int) -> Settings:
    return Settings(
        model=ModelPreset.TINY, rankers=1, users=1000, median_long_term=32, max_long_term=64,
        gap_ms=10.0, slo_ms=50.0, margin_ms=40.0, qps_from=10.0, qps_min=5.0, qps_max=10.0,
        qps_step=5.0,
        min_duration_s=2.0, min_queries=30, timeout_s=5.0, seed=seed,
    )  # fmt: skip


def test_each_test_gets_the_seed_s_visits_with_users_of_its_own() -> None:
    chosen = settings(seed=11)
    first = visits(chosen, CACHE_ONLY, 4.0)
    assert len(first) == chosen.test(4.0).visits_needed()
    again = visits(chosen, CACHE_ONLY, 4.0)
    assert [r.prefix.user_id for r in again] == [r.prefix.user_id for r in first]
    assert [len(r.prefix.long_term) for r in again] == [len(r.prefix.long_term) for r in first]
    # Another system or QPS: the same draws under user ids of its own (no warmed cache).
    other = visits(chosen, RELAY_ALL, 4.0)
    assert {r.prefix.user_id for r in other}.isdisjoint(r.prefix.user_id for r in first)
    assert [len(r.prefix.long_term) for r in other] == [len(r.prefix.long_term) for r in first]
    faster = visits(chosen, CACHE_ONLY, 6.0)
    assert {r.prefix.user_id for r in faster}.isdisjoint(r.prefix.user_id for r in first)


def test_the_command_imports_loadgen_only_when_a_test_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The base install (no `loadgen` extra) can import the command and read its --help."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, tooling.local.loadgen; "
         "print('mlperf_loadgen' in sys.modules)"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "False"
    monkeypatch.setitem(sys.modules, "mlperf_loadgen", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"pip install 'relaygr\[loadgen\]'"):
        import_loadgen()
