"""What a benchmark saves: the stamp taken as the run starts, every Rank's latency, small files."""

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import bench.pipeline as pipeline
from bench.report import dumps_result
from tooling.local import run_stamp
from tooling.local.drive import Point


def test_save_results_keeps_the_stamp_taken_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run saved after each seed keeps the commit it started at, whatever HEAD is by then."""
    monkeypatch.setattr(pipeline, "ROOT", tmp_path)
    started = {
        "date": "2026-12-04 05:00 UTC",
        "commit": "abc123-dirty",
        "machine": "m",
        "threads": 0,
    }
    monkeypatch.setattr(run_stamp, "git_commit", lambda: "later-commit")
    args = argparse.Namespace(seed=7, quick=False, tag="")
    saved = pipeline.save_results("x_bench", args, {"points": []}, started, threads=3)
    on_disk = json.loads((tmp_path / "bench" / "results" / "x_bench.json").read_text())
    assert on_disk["machine"] == saved["machine"] == {**started, "threads": 3}
    assert started["threads"] == 0  # the caller's stamp is not changed


def test_git_commit_says_dirty_for_a_changed_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "repo"
    (repo / "relaygr" / "local").mkdir(parents=True)
    here = repo / "relaygr" / "local" / "run_stamp.py"
    here.write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True)
    monkeypatch.setattr(run_stamp, "__file__", str(here))
    assert run_stamp.git_commit() == head.stdout.strip()
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "bench" / "results" / "r.json").write_text("{}")  # results being written: clean
    assert run_stamp.git_commit() == head.stdout.strip()
    here.write_text("x = 2\n")
    assert run_stamp.git_commit() == f"{head.stdout.strip()}-dirty"


def test_a_saved_point_keeps_every_rank_latency_and_rebuilds() -> None:
    seed = 11
    print(f"seed {seed}")
    latencies = list(np.random.default_rng(seed).lognormal(6.5, 0.4, 300) + 1e-3)
    point = Point("relay all", 2.0, sent=300, ok=300, latencies_ms=latencies)
    kept = json.loads(json.dumps(point.summary()))
    assert kept["latencies_ms"] == [round(v, 2) for v in latencies]
    again = Point(**kept)
    assert np.percentile(again.latencies_ms, 99) == pytest.approx(
        np.percentile(latencies, 99), abs=0.005
    )
    assert Point("x", 1.0, latencies_ms=[1.0]).summary(latencies=False)["latencies_ms"] == []


def test_a_result_file_with_300_ranks_a_point_stays_small() -> None:
    """84 points (the relay benchmark's three seeds) of 300 Ranks: well under 2 MB, and each
    point's latencies on one line."""
    rng = np.random.default_rng(3)
    points = [
        Point("relay all", 1.0, ok=300, latencies_ms=list(rng.lognormal(7, 1, 300))).summary()
        for _ in range(84)
    ]
    text = dumps_result({"points": points, "rates": [0.5, 1.0]})
    assert json.loads(text)["points"] == points
    assert len(text.encode()) < 400_000
    assert text.count("\n") < 84 * 30
    assert '"rates": [0.5, 1.0]' in text
