"""bench/engine_batch_bench.py renders its section from a saved result alone: hand-made results
(no engine runs here) give the verdicts their figures call for, and re-rendering a smoke run
never touches the docs."""

from pathlib import Path
from typing import Any

import pytest

import bench.engine_batch_bench as engine_batch
from bench.engine_batch_bench import BATCHED, LOW_LOAD, SATURATION, UNBATCHED
from bench.report import dumps_result

LOW_RATE = 5.0


def _phase(
    seed: int,
    long_term: int,
    variant: str,
    phase: str,
    wall_s: float,
    calls: int,
    n: int,
    extra_ms: float = 0.0,
) -> dict[str, Any]:
    """`n` Ranks with latencies 10.00, 10.01, ... ms, plus `extra_ms`."""
    return {
        "seed": seed,
        "long_term": long_term,
        "variant": variant,
        "phase": phase,
        "ranks": n,
        "wall_s": wall_s,
        "offered_per_s": LOW_RATE if phase == LOW_LOAD else None,
        "calls": calls,
        "misses": 0,
        "latencies_ms": [round(10 + extra_ms + i / 100, 2) for i in range(n)],
    }


def _saved(
    seeds: list[int],
    speedups: dict[int, float],
    n: int,
    quick: bool,
    low_extra_ms: float = 0.0,
) -> dict[str, Any]:
    """A result at `speedups`' lengths: unbatched 25 Ranks/s at saturation, batched that times
    faster in calls of 4; at low load every call scores one Rank, the batched engine's
    `low_extra_ms` later."""
    phases = []
    for seed in seeds:
        for long_term, speedup in speedups.items():
            phases += [
                _phase(seed, long_term, UNBATCHED, SATURATION, n / 25, n, n),
                _phase(seed, long_term, BATCHED, SATURATION, n / 25 / speedup, n // 4, n),
                _phase(seed, long_term, UNBATCHED, LOW_LOAD, n / LOW_RATE, n, n),
                _phase(seed, long_term, BATCHED, LOW_LOAD, n / LOW_RATE, n, n, low_extra_ms),
            ]
    return {
        "command": ".venv/bin/python bench/engine_batch_bench.py --seed 7",
        "machine": {
            "date": "2026-12-04 10:00 UTC",
            "commit": "abc123",
            "machine": "test CPU",
            "threads": 1,
            "torch": "2.x",
            "python": "3.11",
        },
        "quick": quick,
        "seeds": seeds,
        "workload": {
            "user_features": 8,
            "long_term": list(speedups),
            "short_term": 32,
            "candidates": 128,
            "users": 16,
            "outstanding": 16,
            "warmup": 32,
            "ranks": n,
            "low_load_ranks": n,
            "low_load_share": 0.2,
            "low_load_rate": None,
            "max_batch": 8,
            "max_batch_rows": 4096,
        },
        "flops_per_rank": {str(n): 1_000_000_000 for n in speedups},  # 1 GFLOP a Rank
        "targets": {"throughput_ratio": 1.5},
        "matmul_peak": {"gflops_per_s": 100.0, "tries": 5},
        "load_average_1m": {"start": 0.1, "end": 0.2},
        "wall_s": 1800.0,
        "phases": phases,
    }


def test_three_seeds_give_met_and_not_met_with_their_figures() -> None:
    text = engine_batch.render(_saved([1, 2, 3], {256: 2.0, 1024: 1.2}, 100, quick=False))
    lines = text.splitlines()
    assert lines[0] == "## Engine: cached Ranks batched across requests, saturation and low load"
    assert (
        "this run: `.venv/bin/python bench/engine_batch_bench.py --seed 7`; about 30 minutes"
        in text
    )
    # 25 Ranks/s unbatched, 1 GFLOP each, over a 100 GFLOP/s peak: 25%; batched 2x: 50%.
    assert any(line.startswith("| 264 | 25.0 | 50.0 | 2x (per seed 2-2x;") for line in lines)
    assert any(line.startswith("| 1,032 | 25.0 | 30.0 | 1.2x") for line in lines)
    assert "| 4.00 | 25%, 50% |" in text
    assert "| 264 | 5.0 | " in text  # the low-load rate offered
    [ratio] = [line for line in lines if line.startswith("- Throughput ratio")]
    assert ratio.startswith("- Throughput ratio at least 1.5x at each length: **not met** (264")
    [p99] = [line for line in lines if line.startswith("- Low-load P99 no worse")]
    assert "**met**" in p99 and "n=300" in p99  # 100 Ranks a seed, pooled over 3 seeds
    assert (
        "- Short of the target at 1,032 tokens: batching raised throughput 1.20x, with 4.00 "
        "Ranks a call; the unbatched engine ran at 25% of the matmul peak (batched 30%), so the "
        "unbatched calls left the BLAS room that batching did not take." in lines
    )
    assert "Short of the target at 264" not in text
    assert "smoke run" not in text


def test_a_ratio_met_everywhere_is_met() -> None:
    text = engine_batch.render(_saved([1, 2, 3], {256: 1.6, 4096: 1.5}, 100, quick=False))
    assert "at each length: **met** (264 tokens 1.6x" in text
    assert "Short of the target" not in text


def test_a_batched_low_load_p99_past_the_unbatched_bound_is_not_met() -> None:
    text = engine_batch.render(_saved([1, 2, 3], {256: 2.0}, 100, quick=False, low_extra_ms=5))
    assert "upper 95% bound): **not met** (264 tokens batched 16 ms" in text
    assert (
        "- At 264 tokens the batched low-load P99 came out above the unbatched one's upper "
        "bound; every call scored one Rank (mean batch 1.00), the same calls as unbatched, so "
        "the gap is run-to-run spread, not batching." in text.splitlines()
    )


def test_a_smoke_run_renders_indicative_verdicts() -> None:
    text = engine_batch.render(_saved([5], {256: 1.2}, 40, quick=True))
    assert "at each length: **indicative (seeds=1)**" in text
    assert "upper 95% bound): **indicative (n=40)**" in text
    assert text.endswith("A smoke run (`--quick`): too few Ranks and seeds for a verdict.")


def test_rerendering_a_saved_smoke_run_prints_it_and_leaves_the_docs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved([5], {256: 1.2}, 40, quick=True)
    path = tmp_path / "engine_batch_bench.quick.json"
    path.write_text(dumps_result(saved))
    monkeypatch.setattr(engine_batch, "ROOT", tmp_path)
    assert engine_batch.main(["--from-json", str(path)]) == 0
    assert capsys.readouterr().out.strip() == engine_batch.render(saved)
    assert not (tmp_path / "docs").exists()
