"""The mesh point's simulated twin (bench/sim_twin.py): the relay benchmark's trace, no-shows
included, through the simulator on the stored measured profile, end to end on a short run."""

from pathlib import Path

import numpy as np
import pytest

import bench.pipeline as pipeline
from bench.sim_twin import PAIRS, SYSTEMS, measured_profile, parse, render, run


def test_the_twin_replays_the_benchmarks_trace_with_its_no_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    stored = pipeline.ROOT / "bench" / "results" / "sim_validate.json"
    monkeypatch.setattr(pipeline, "ROOT", tmp_path)  # the result file goes there
    seed = int(rng.integers(0, 2**31))
    args = parse(
        ["--seed", str(seed), "--seeds", "1", "--duration", "40", "--rates", "1.5",
         "--no-show", "0.5", "--hbm-mb", "24", "--profile-from", str(stored), "--no-docs"]
    )  # fmt: skip
    profile = measured_profile(stored, 24)
    assert (profile.device_tier_bytes, profile.host_tier_bytes) == (24 << 20, 96 << 20)
    saved = run(args)
    rows = {r["label"]: r for r in saved["rows"]}
    assert set(rows) == set(SYSTEMS)
    for row in rows.values():
        decided = sum(row["reasons"].values())  # every retrieval's decision, ranked or not
        assert 0.3 < row["sent"] / decided < 0.7  # half never ranked
        assert row["ok"] == row["sent"] and len(row["latencies_ms"]) == row["ok"]
    assert rows["relay all"]["relayed"] > 0 and rows["no cache"]["relayed"] == 0
    assert (tmp_path / "bench" / "results" / "sim_twin.json").exists()
    text = render(saved)
    for label in SYSTEMS:
        assert f"| {label} |" in text
    for ours, theirs in PAIRS:
        assert f"- {ours} against {theirs}: at or below it in" in text
