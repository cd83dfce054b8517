"""`relaygr loadgen` against a real mesh on loopback (tiny model, seconds): LoadGen's Server
scenario issues the queries, each one a retrieval event and then a Rank; the search, the
trigger's mode per system, the verdict and the logs LoadGen leaves."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.trigger.policy import relays_admitted
from tests.integration.process_mesh import tiny_mesh
from tooling.local import loadgen
from tooling.local.loadgen_sut import DETAIL_LOG, SUMMARY_LOG
from tooling.local.mesh import LocalMesh

# Short histories, a generous SLO and a P90 target: LoadGen's early stopping can pass on ~60
# queries, so a test takes a few seconds and most are valid on a loaded machine.
TRAFFIC = [
    "--median-long-term", "48", "--max-long-term", "96", "--users", "5000",
    "--gap-ms", "20", "--slo-ms", "400", "--percentile", "0.9",
    "--min-duration-s", "2", "--min-queries", "60", "--timeout", "10",
]  # fmt: skip


@pytest.fixture(scope="module")
def mesh() -> LocalMesh:
    spec, _ = tiny_mesh(trigger_args=("--slo-ms", "400", "--margin-ms", "390"))
    with LocalMesh(spec) as started:
        yield started


def test_the_search_runs_each_system_on_a_running_mesh(
    mesh: LocalMesh, tmp_path: Path, rng: np.random.Generator
) -> None:
    assert mesh.trigger is not None
    seed = int(rng.integers(2**31))
    out = tmp_path / "out"
    argv = [
        "--router", mesh.router_target, "--trigger", mesh.trigger.address,
        "--etcd", mesh.etcd_endpoint, "--modes", "cache only", "relay all",
        "--qps-from", "10", "--qps-step", "10", "--qps-max", "30", "--seed", str(seed),
        "--out", str(out), *TRAFFIC,
    ]  # fmt: skip
    assert loadgen.main(argv) == 0
    saved = json.loads((out / "loadgen.json").read_text())
    assert saved["command"].startswith("relaygr loadgen --router")
    assert saved["machine"]["commit"]  # stamped at the start, "-dirty" on a dirty tree
    assert saved["settings"]["target_latency_ms"] == 420.0
    assert list(saved["modes"]) == ["cache only", "relay all"]
    for label, found in saved["modes"].items():
        runs = found["runs"]
        tried = [run["qps"] for run in runs]
        assert tried[0] == 10.0 and set(tried) <= {10.0, 20.0, 30.0}, tried
        valid = [run["qps"] for run in runs if run["valid"]]
        assert found["highest_valid_qps"] == max(valid, default=0.0)
        for run in runs:
            verdict, pipeline = run["loadgen"], run["pipeline"]
            logs = Path(run["logs"])
            assert (logs / DETAIL_LOG).is_file() and (logs / SUMMARY_LOG).is_file()
            assert f"Result is : {verdict['validity']}" in run["summary"]
            # Every query LoadGen issued was one visit: its retrieval event, then its Rank.
            assert verdict["queries"] == pipeline["sent"] == pipeline["ok"] >= 60, (label, run)
            assert not pipeline["errors"]
            assert run["valid"] == (verdict["validity"] == "VALID")
            assert sum(pipeline["reasons"].values()) == pipeline["sent"]
            if label == "cache only":  # the trigger was switched through etcd
                assert set(pipeline["reasons"]) == {"relay_disabled"}, pipeline["reasons"]
            else:
                assert relays_admitted(pipeline["reasons"]) > 0, pipeline["reasons"]
                assert pipeline["relayed"] > 0


def test_smoke_prints_loadgen_s_verdict(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tooling.cli", "loadgen", "--smoke", "--min-duration-s", "3",
         "--qps-from", "10", "--seed", "5", "--out", str(tmp_path), *TRAFFIC[:6]],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "relay sequence-aware: LoadGen Server scenario at 10 QPS" in done.stdout
    assert "LoadGen: Result is " in done.stdout, done.stdout
    saved = json.loads((tmp_path / "loadgen.json").read_text())
    assert saved["settings"]["smoke"] and saved["settings"]["model"] == "tiny"
    [run] = saved["modes"]["relay sequence-aware"]["runs"]
    assert f"LoadGen: Result is {run['loadgen']['validity']}" in done.stdout
