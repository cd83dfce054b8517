"""Throughput of cached Ranks batched across requests vs the same Ranks one call each.

By default on this CPU with the default model in fp32; `--device cuda --model hstu-24x1024
--precision bf16` measures an accelerator with the accelerator profiles' model shape
(profiles/README.md), timing after a device synchronise.

For each seed and prefix length, 16 users get their own prefix (prefilled, untimed), short-term
behaviours and 128-256 candidates. For each batch size B the first B users' Ranks run as B
single `rank` calls and as one `rank_batch` call, interleaved (singles, batch, singles, ...)
after warm-up, so drift in machine load hits both alike. The speed-up is the B singles' time
over the batch's; the batch's analytic FLOPs over its time, against the fp32 matmul peak
measured in the same run (model_bench's measurement), give its share of the peak. Results go
to JSON and to a marked section of docs/benchmarks.md.
"""

import argparse
import contextlib
import json
import os
import secrets
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.model_bench import (
    device_sync,
    matmul_peak,
    matmul_rates,
    no_sync,
    random_behaviours,
    rank_flops,
    seconds,
)
from bench.report import add_render_arguments, load_result, machine_info, run_stamp, write_section
from relaygr.behaviours import Prefix, UserId
from relaygr.bounds import AT_LEAST_ONE, Bounded
from relaygr.cli_help import HelpFormatter
from relaygr.device import select_device
from services.ranker.model import RankingModel, RankItem
from services.ranker.model_config import KVDtype, ModelConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
COMMAND = ".venv/bin/python bench/batch_bench.py"
# A result's docs/benchmarks.md section is its file's stem, between <!-- STEM:start/end -->
# (batch_bench for the CPU run, batch_bench_cuda for a CUDA one).
LENGTHS = (256, 1024, 4096)  # long-term behaviours; the prefix adds USER_FEATURES
QUICK_LENGTHS = (256,)
BATCHES = (1, 2, 4, 8, 16)
QUICK_BATCHES = (1, 4)
USER_FEATURES = 8
SHORT_TERM = 64
CANDIDATES = (128, 256)  # drawn per user, inclusive
SPEEDUP_TARGET = 1.5  # issue 27: batched vs unbatched throughput
PEAK_FRACTION_TARGET = 0.7
REQUEST_TS = 1_700_000_000
PREFILL_REPEATS = 3  # timed prefills of one user per seed and length
# The model shapes a run can measure: the project's default (sized for two CPU cores) and the
# accelerator profiles' HSTU (24 layers, d_model 1024, 4 heads of 256, no feed-forward block,
# bf16 KV; profiles/nvidia-h200.toml).
MODELS = {
    "default": ModelConfig(),
    "hstu-24x1024": ModelConfig(
        num_layers=24, d_model=1024, num_heads=4, d_qk=256, d_v=256, ffn_mult=0,
        kv_dtype=KVDtype.BFLOAT16,
    ),
}  # fmt: skip
# How matrix products run: fp32 as the model is written, or tf32 (fp32 data, CUDA tensor
# cores; the model's in-place products rule out autocasting it to bf16).
PRECISIONS = ("fp32", "tf32")


@dataclass(frozen=True, slots=True)
class Settings:
    """What one bench run measures; built once from the command line."""

    seeds: tuple[int, ...]
    threads: int
    device: str
    model: str
    precision: str
    quick: bool
    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    repeats: int
    warmup: int
    peak_sizes: tuple[int, ...]
    peak_tries: int
    output: Path
    docs: Path | None
    from_json: Path | None


@dataclass(frozen=True, slots=True)
class Cell:
    """One seed, prefix length and batch size: medians over the timed pairs, milliseconds."""

    seed: int
    long_term: int
    batch: int
    rows: int  # short-term + candidate rows of the whole batch
    flops: int
    singles_ms: float  # the B Ranks as B calls, in total
    batch_ms: float  # the B Ranks as one call
    best_batch_ms: float  # the fastest batch: best-of, as the matmul peak is measured
    speedup: float  # median over pairs of singles / batch (a pair runs back to back)
    max_rel_err: float  # batched vs single scores


@dataclass(frozen=True, slots=True)
class Prefill:
    """One seed and prefix length: the median of timed prefills (full inference over the
    prefix, what a relay pre-infers) of one user, milliseconds."""

    seed: int
    long_term: int
    prefill_ms: float


CUT_TS = REQUEST_TS - 3_600  # long-term behaviours end here, short-term ones start


def _prefix(cfg: ModelConfig, rng: np.random.Generator, user: int, long_term: int) -> Prefix:
    return Prefix(
        user_id=UserId(f"bench-user-{user}"),
        user_features=rng.integers(0, 1 << 20, size=USER_FEATURES),
        long_term=random_behaviours(cfg, rng, long_term, REQUEST_TS - 2 * 365 * 86_400, CUT_TS),
    )


def _items(
    model: RankingModel, rng: np.random.Generator, long_term: int, count: int
) -> list[RankItem]:
    cfg = model.cfg
    items = []
    for i in range(count):
        prefix = _prefix(cfg, rng, i, long_term)
        short = random_behaviours(cfg, rng, SHORT_TERM, CUT_TS, REQUEST_TS)
        candidates = rng.integers(
            0, 1 << 40, size=int(rng.integers(CANDIDATES[0], CANDIDATES[1] + 1))
        )
        items.append(RankItem(model.prefill(prefix), short, candidates, REQUEST_TS))
    return items


def _ms(fn: Callable[[], object], sync: Callable[[], None] = no_sync) -> float:
    return 1e3 * seconds(fn, sync)


@contextlib.contextmanager
def precision(device: torch.device, name: str) -> Iterator[None]:
    """Matrix products in fp32, or in tf32 on a CUDA device's tensor cores."""
    if name == "fp32":
        yield
        return
    if device.type != "cuda":
        raise SystemExit(f"precision {name} needs a CUDA device, not {device}")
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def bench_prefill(model: RankingModel, prefix: Prefix, seed: int) -> Prefill:
    sync = device_sync(model.device)
    model.prefill(prefix)  # warm-up
    times = [_ms(lambda: model.prefill(prefix), sync) for _ in range(PREFILL_REPEATS)]
    return Prefill(seed, len(prefix.long_term), statistics.median(times))


def bench_cell(
    model: RankingModel, items: list[RankItem], settings: Settings, seed: int, long_term: int
) -> Cell:
    def singles() -> list[torch.Tensor]:
        return [model.rank(i.kv, i.short_term, i.candidates, i.request_ts) for i in items]

    def batch() -> list[torch.Tensor]:
        return model.rank_batch(items)

    alone, together = singles(), batch()
    err = max(
        float((a - b).abs().max() / a.abs().max()) for a, b in zip(alone, together, strict=True)
    )
    for _ in range(settings.warmup):
        singles()
        batch()
    single_ms, batch_ms = [], []
    sync = device_sync(model.device)
    for _ in range(settings.repeats):
        single_ms.append(_ms(singles, sync))
        batch_ms.append(_ms(batch, sync))
    cfg = model.cfg
    return Cell(
        seed=seed,
        long_term=long_term,
        batch=len(items),
        rows=sum(len(i.short_term) + len(i.candidates) for i in items),
        flops=sum(
            rank_flops(cfg, i.kv.num_tokens, len(i.short_term), len(i.candidates)) for i in items
        ),
        singles_ms=statistics.median(single_ms),
        batch_ms=statistics.median(batch_ms),
        best_batch_ms=min(batch_ms),
        speedup=statistics.median(s / b for s, b in zip(single_ms, batch_ms, strict=True)),
        max_rel_err=err,
    )


# --------------------------------------------------------------------------------------------
# Attention layout: jagged (one product per user, what the model runs) vs padded by bucket

LAYOUT_CASES = {
    "8 users x 1,032 keys": (1032,) * 8,
    "16 users x 264 keys": (264,) * 16,
    "8 users, 264-4,104 keys": (264, 1032, 4104, 264, 1032, 2056, 520, 4104),
}


def layout_times(
    cfg: ModelConfig, keys: Sequence[int], repeats: int, seed: int, device: torch.device
) -> dict[str, float]:
    """Best-of-`repeats` ms of one layer's candidate attention (192 candidates a user, the
    model's heads and widths) over users with `keys` prefix keys each: jagged, a product per
    user against its own keys, vs padded, every user's keys copied into one zero-padded
    [users, heads, max keys, d] block and one batched product (padded keys have zero values,
    so they add nothing: the same result)."""
    g = torch.Generator().manual_seed(seed)
    heads, rows = cfg.num_heads, 192
    qs = [torch.randn(heads, rows, cfg.d_qk, generator=g).to(device) for _ in keys]
    ks = [torch.randn(heads, n, cfg.d_qk, generator=g).to(device) for n in keys]
    vs = [torch.randn(heads, n, cfg.d_v, generator=g).to(device) for n in keys]
    biases = [torch.randn(n, generator=g).to(device) for n in keys]

    def jagged() -> None:
        for q, k, v, b in zip(qs, ks, vs, biases, strict=True):
            scores = torch.bmm(q, k.transpose(1, 2)).add_(b)
            torch.bmm(F.silu(scores, inplace=True), v)

    def padded() -> None:
        users, longest = len(keys), max(keys)
        k_all = torch.zeros(users, heads, longest, cfg.d_qk, device=device)
        v_all = torch.zeros(users, heads, longest, cfg.d_v, device=device)
        b_all = torch.zeros(users, 1, 1, longest, device=device)
        for i, (k, v, b) in enumerate(zip(ks, vs, biases, strict=True)):
            k_all[i, :, : len(b)], v_all[i, :, : len(b)], b_all[i, 0, 0, : len(b)] = k, v, b
        scores = torch.matmul(torch.stack(qs), k_all.transpose(2, 3)).add_(b_all)
        torch.matmul(F.silu(scores, inplace=True), v_all)

    jagged()  # warm both
    padded()
    sync = device_sync(device)
    times: dict[str, list[float]] = {"jagged_ms": [], "padded_ms": []}
    for _ in range(repeats):
        times["jagged_ms"].append(_ms(jagged, sync))
        times["padded_ms"].append(_ms(padded, sync))
    return {name: min(values) for name, values in times.items()}


def summarise(cells: Sequence[dict[str, Any]], peak: float) -> list[dict[str, Any]]:
    """Per (length, batch): median and range over seeds of the speed-up, the batch's
    throughput and its share of the matmul peak, and the singles' share."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["long_term"], cell["batch"]), []).append(cell)
    rows = []
    for (long_term, batch), group in sorted(groups.items()):
        speedups = [c["speedup"] for c in group]
        throughput = [1e3 * batch / c["batch_ms"] for c in group]
        share = [c["flops"] / (c["best_batch_ms"] / 1e3) / 1e9 / peak for c in group]
        single = [c["singles_ms"] / batch for c in group]
        rows.append(
            {
                "long_term": long_term,
                "prefix_tokens": long_term + USER_FEATURES,
                "batch": batch,
                "seeds": len(group),
                "speedup": _stats(speedups),
                "batch_ranks_per_s": _stats(throughput),
                "batch_peak_fraction": _stats(share),
                "single_rank_ms": _stats(single),
                "max_rel_err": max(c["max_rel_err"] for c in group),
            }
        )
    return rows


def savings(cells: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per length: what each request after the first saved by sharing a call, ms, over every
    seed and batch of two or more: (singles - batch) / (B - 1), the batch term
    (`CostModel.batch_saving_ms`) this CPU's ranker would fit (services/ranker/cost_fit.py)."""
    per_length: dict[int, list[float]] = {}
    for c in cells:
        if c["batch"] > 1:
            saving = (c["singles_ms"] - c["batch_ms"]) / (c["batch"] - 1)
            per_length.setdefault(c["long_term"], []).append(saving)
    return {n: _stats(v) for n, v in sorted(per_length.items())}


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# --------------------------------------------------------------------------------------------
# Report


def _range(stats: dict[str, float], fmt: str, scale: float = 1.0) -> str:
    low, mid, high = (scale * stats[k] for k in ("min", "median", "max"))
    return f"{mid:{fmt}} ({low:{fmt}}-{high:{fmt}})"


def render_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| prefix tokens | B | speed-up vs B singles | batch Ranks/s | batch % of peak "
        "| single Rank ms | max rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prefix_tokens']:,} | {r['batch']} | {_range(r['speedup'], '.2f')}x "
            f"| {_range(r['batch_ranks_per_s'], '.1f')} "
            f"| {_range(r['batch_peak_fraction'], '.0f', 100)} "
            f"| {_range(r['single_rank_ms'], '.0f')} | {r['max_rel_err']:.1e} |"
        )
    return lines


def interpret(result: dict[str, Any]) -> str:
    """Sentences judging the run against the issue's targets, length by length."""
    rows = result["summary"]
    cpu = not _on_accelerator(result)
    sentences = []
    for long_term in sorted({r["long_term"] for r in rows}):
        at = [r for r in rows if r["long_term"] == long_term and r["batch"] > 1]
        if not at:
            continue
        best = max(at, key=lambda r: r["speedup"]["median"])
        peak = max(r["batch_peak_fraction"]["median"] for r in at)
        met = "meets" if best["speedup"]["median"] >= SPEEDUP_TARGET else "misses"
        sentences.append(
            f"At {long_term + USER_FEATURES:,} prefix tokens the best batch (B={best['batch']}) "
            f"runs {best['speedup']['median']:.2f}x the throughput of single calls, so it {met} "
            f"the {SPEEDUP_TARGET}x target, and the batch reaches at most {100 * peak:.0f}% of "
            f"the matmul peak (goal {100 * PEAK_FRACTION_TARGET:.0f}%)."
        )
    for long_term, saving in savings(result["cells"]).items() if cpu else ():
        single = statistics.median(
            r["single_rank_ms"]["median"] for r in rows if r["long_term"] == long_term
        )
        sentences.append(
            f"At {long_term + USER_FEATURES:,} tokens each request after the first saves "
            f"{saving['median']:.1f} ms (range {saving['min']:.1f} to {saving['max']:.1f}) of "
            f"a {single:.0f} ms single Rank."
        )
    if _on_accelerator(result):
        return " ".join([*sentences, _accelerator_reading(result)])
    if max(r["batch_peak_fraction"]["max"] for r in rows) > 1:
        sentences.append(
            "Shares above 100% show that foreign load on the shared machine depressed the peak "
            "measured in this run (or slowed single calls, when the speed-up is high), so the "
            "shares and single-call times are noisy; the speed-ups compare calls run back to "
            "back and are the steadier figure."
        )
    sentences.append(
        "On this CPU a single cached Rank already multiplies a few hundred rows per projection, "
        "which the BLAS runs near its best rate, and attention (per user, against its own "
        "prefix) is the same work batched or not; batching saves only per-call overheads and "
        "some GEMM blocking. What batching buys an accelerator, where a few hundred rows leave "
        "most of the device idle, is not measured here (profiles/README.md)."
    )
    return " ".join(sentences)


def _on_accelerator(result: dict[str, Any]) -> bool:
    return not str(result.get("device", "cpu")).startswith("cpu")


def _accelerator_reading(result: dict[str, Any]) -> str:
    """What the accelerator run says about the profiles' batching assumption."""
    per_length = "; ".join(
        f"{n + USER_FEATURES:,} tokens {s['median']:.2f} ms ({s['min']:.2f} to {s['max']:.2f})"
        for n, s in savings(result["cells"]).items()
    )
    return (
        f"Each request after the first saves, median over seeds and batches (range): "
        f"{per_length}; the "
        "accelerator profiles assume 1.0 ms (`batch_saving_ms = fixed_ms`, "
        "profiles/README.md). The model is the project's own code (a kernel or more per "
        "operation, attention per user against its own prefix), not a fused production kernel."
    )


def render_prefills(result: dict[str, Any]) -> list[str]:
    prefills = result.get("prefills", [])
    if not prefills:
        return []
    lengths = sorted({p["long_term"] for p in prefills})
    parts = []
    for n in lengths:
        times = [p["prefill_ms"] for p in prefills if p["long_term"] == n]
        parts.append(
            f"{n + USER_FEATURES:,} tokens {statistics.median(times):.1f} ms "
            f"({min(times):.1f}-{max(times):.1f})"
        )
    return [
        "",
        f"Prefill of one user's prefix (full inference, what a relay pre-infers; median of "
        f"{PREFILL_REPEATS} after a warm-up, median and range over seeds): {'; '.join(parts)}.",
    ]


def render_layout(layout: dict[str, dict[str, float]], where: str = "On this CPU") -> list[str]:
    if not layout:
        return []
    lines = [
        "",
        "Attention layout, one layer's candidate attention (192 candidates a user), best of "
        "5: jagged (a product per user against its own keys, what `rank_batch` runs) vs padded "
        "by bucket (keys copied into one zero-padded block, one batched product):",
        "",
        "| users and prefix keys | jagged ms | padded ms |",
        "|---|---:|---:|",
    ]
    for name, times in layout.items():
        lines.append(f"| {name} | {times['jagged_ms']:.1f} | {times['padded_ms']:.1f} |")
    if all(t["jagged_ms"] <= t["padded_ms"] for t in layout.values()):
        verdict = (
            f"{where} the jagged layout is as fast or faster whether lengths are equal (the "
            "copy into the padded block costs more than the calls it saves) or mixed (padding "
            "multiplies keys that are not there), so the model runs jagged."
        )
    else:
        verdict = "Padding won at least one case in this run; the model runs jagged."
    return [*lines, "", verdict]


def render_section(result: dict[str, Any]) -> str:
    if _on_accelerator(result):
        return render_accelerator_section(result)
    machine = result["machine"]
    work = result["workload"]
    seeds = ", ".join(str(s) for s in result["seeds"])
    lines = [
        "## Model: cached Ranks batched across requests",
        "",
        f"Reproduce: `make bench-batch` (runs `{result['command']}`; this run: seeds {seeds}, "
        f"{machine['threads']} torch thread(s)); about {result['wall_s'] / 60:.0f} minutes.",
        "",
        f"- {run_stamp(machine)}; torch {machine['torch']}, {machine['threads']} torch "
        "thread(s): the machine is shared, so one thread is less disturbed by foreign load.",
        f"- Model: {_model_name(result)}. Each user: {work['user_features']} user features + "
        f"the long-term prefix (cached, prefill untimed), {work['short_term']} short-term "
        f"behaviours, {work['candidates'][0]}-{work['candidates'][1]} candidates (drawn).",
        f"- Per seed, length and B: {result['repeats']} timed pairs (B single `rank` calls, "
        f"then one `rank_batch` of the same B Ranks) after {result['warmup']} warm-up pair(s); "
        "per seed the speed-up is the median over pairs of singles / batch (a pair runs back to "
        "back, so a burst of foreign load mostly hits one pair) and Ranks/s the median batch's; "
        "the share of the peak uses the fastest batch, as the peak is a best-of. The table "
        "gives the median over seeds and (range).",
        f"- Matmul peak (model_bench's best-of-{result['matmul_peak']['tries']} `torch.mm`, "
        f"before and after the rows): {result['matmul_peak']['gflops_per_s']:.1f} GFLOP/s. "
        "FLOPs are analytic matmul FLOPs (bench/model_bench.py `rank_flops`).",
        f"- 1-minute load average: {result['load_average_1m']['start']:.2f} at the start, "
        f"{result['load_average_1m']['end']:.2f} at the end.",
        "",
        *render_table(result["summary"]),
        "",
        interpret(result),
        *render_layout(result.get("layout", {})),
    ]
    return "\n".join(lines)


def _model_name(result: dict[str, Any]) -> str:
    name = result.get("model", "default")
    if name == "default":
        return "default `ModelConfig()`"
    cfg = result["config"]
    return (
        f"`{name}` ({cfg['num_layers']} layers, d_model {cfg['d_model']}, {cfg['num_heads']} "
        f"heads of {cfg['d_qk']}/{cfg['d_v']} (q.k/v), feed-forward x{cfg['ffn_mult']}, "
        f"{cfg['kv_dtype']} KV)"
    )


def render_accelerator_section(result: dict[str, Any]) -> str:
    machine, work = result["machine"], result["workload"]
    seeds = ", ".join(str(s) for s in result["seeds"])
    lines = [
        f"## Model on {result['device']}: cached Ranks batched across requests",
        "",
        f"Reproduce, on a machine with the device: `{result['command']}` (this run: seeds "
        f"{seeds}); about {result['wall_s'] / 60:.0f} minutes.",
        "",
        f"- {run_stamp(machine)}; torch {machine['torch']}, timed after a device synchronise.",
        f"- Model: {_model_name(result)}, matrix products in {result['precision']}. Each user: "
        f"{work['user_features']} user features + the long-term prefix (cached, prefill timed "
        f"apart), {work['short_term']} short-term behaviours, {work['candidates'][0]}-"
        f"{work['candidates'][1]} candidates (drawn).",
        f"- Per seed, length and B: {result['repeats']} timed pairs (B single `rank` calls, "
        f"then one `rank_batch` of the same B Ranks) after {result['warmup']} warm-up pair(s); "
        "the table gives the median over seeds and (range).",
        f"- Matmul peak (best-of-{result['matmul_peak']['tries']} `torch.mm` in "
        f"{result['precision']} on the device, before and after the rows): "
        f"{result['matmul_peak']['gflops_per_s'] / 1e3:.0f} TFLOP/s. FLOPs are analytic "
        "matmul FLOPs (bench/model_bench.py `rank_flops`).",
        "",
        *render_table(result["summary"]),
        *render_prefills(result),
        "",
        interpret(result),
        *render_layout(result.get("layout", {}), where=f"On {result['device']}"),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(
        description="Throughput of cached Ranks batched across requests vs one call each.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--seeds",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help="comma-separated input seeds (default: 3 random)",
    )
    parser.add_argument(
        "--threads", type=Bounded(int, AT_LEAST_ONE), default=1, help="torch threads (default: 1)"
    )
    parser.add_argument(
        "--repeats", type=Bounded(int, AT_LEAST_ONE), default=4, help="timed pairs per cell"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed pairs per cell")
    parser.add_argument(
        "--device", default="cpu", help="torch device: cpu, cuda or npu (default: cpu)"
    )
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="default", help="model shape (default: default)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32, or tf32 on CUDA tensor cores; the matmul peak is measured in the same "
        "(default: fp32)",
    )
    parser.add_argument(
        "--batches",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help=f"comma-separated batch sizes (default: {','.join(map(str, BATCHES))})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 256 tokens, B 1 and 4, one seed; writes "
        "bench/results/batch_bench.quick.json and leaves the docs alone",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON result path (default: bench/results/batch_bench.json; "
        "batch_bench.quick.json with --quick)",
    )
    parser.add_argument(
        "--docs", type=Path, default=None, help="Markdown to update (default: docs/benchmarks.md)"
    )
    add_render_arguments(parser)
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    results = REPO_ROOT / "bench" / "results"
    seeds = args.seeds or tuple(secrets.randbits(31) for _ in range(1 if quick else 3))
    stem = "batch_bench" if args.device == "cpu" else f"batch_bench_{args.device}"
    skip_docs = args.no_docs or (quick and args.docs is None)
    return Settings(
        seeds=seeds,
        threads=args.threads,
        device=args.device,
        model=args.model,
        precision=args.precision,
        quick=quick,
        lengths=QUICK_LENGTHS if quick else LENGTHS,
        batches=args.batches or (QUICK_BATCHES if quick else BATCHES),
        repeats=1 if quick else args.repeats,
        warmup=args.warmup,
        peak_sizes=(1024,) if quick else ((1024, 2048) if args.device == "cpu" else (4096, 8192)),
        peak_tries=3 if quick else 5,
        output=args.output or results / (f"{stem}.quick.json" if quick else f"{stem}.json"),
        docs=None if skip_docs else (args.docs or REPO_ROOT / "docs" / "benchmarks.md"),
        from_json=args.from_json,
    )


def run(settings: Settings, argv: Sequence[str]) -> dict[str, Any]:
    torch.set_num_threads(settings.threads)
    device = select_device(settings.device)
    machine = machine_info(settings.threads)  # stamped at the start: the code that ran
    if device.type == "cuda":
        machine["machine"] += f"; {torch.cuda.get_device_name(device)}"
    started = time.perf_counter()
    load_before = os.getloadavg()
    print(f"seeds {settings.seeds}, {settings.threads} thread(s), {device}", flush=True)
    peak_args = (settings.peak_sizes, settings.peak_tries)
    with precision(device, settings.precision):
        before = matmul_rates(*peak_args, settings.seeds[0], device)
    cfg = MODELS[settings.model]
    cells: list[Cell] = []
    prefills: list[Prefill] = []
    for seed in settings.seeds:
        torch.manual_seed(seed)
        model = RankingModel(cfg, seed=seed, device=device)
        rng = np.random.default_rng(seed)
        for long_term in settings.lengths:
            with precision(device, settings.precision):
                prefills.append(bench_prefill(model, _prefix(cfg, rng, 0, long_term), seed))
                _seed_cells(model, rng, settings, seed, long_term, cells)
        del model
    with precision(device, settings.precision):
        layout = {
            name: layout_times(cfg, keys, 5, settings.seeds[0], device)
            for name, keys in (LAYOUT_CASES.items() if not settings.quick else [])
        }
    with precision(device, settings.precision):
        after = matmul_rates(*peak_args, settings.seeds[0] + 1, device)
    peak = matmul_peak(before, after, settings.peak_tries)
    records = [asdict(c) for c in cells]
    return {
        "command": shlex.join([*COMMAND.split(), *argv]),
        "quick": settings.quick,
        "seeds": list(settings.seeds),
        "machine": machine,
        "device": str(device),
        "model": settings.model,
        "precision": settings.precision,
        "config": cfg.to_dict(),
        "workload": {
            "user_features": USER_FEATURES,
            "short_term": SHORT_TERM,
            "candidates": list(CANDIDATES),
            "long_term": list(settings.lengths),
            "batches": list(settings.batches),
        },
        "repeats": settings.repeats,
        "warmup": settings.warmup,
        "matmul_peak": peak,
        "load_average_1m": {"start": load_before[0], "end": os.getloadavg()[0]},
        "wall_s": time.perf_counter() - started,
        "targets": {"speedup": SPEEDUP_TARGET, "peak_fraction": PEAK_FRACTION_TARGET},
        "cells": records,
        "prefills": [asdict(p) for p in prefills],
        "layout": layout,
    }


def _seed_cells(
    model: RankingModel,
    rng: np.random.Generator,
    settings: Settings,
    seed: int,
    long_term: int,
    cells: list[Cell],
) -> None:
    """Every batch size's cell at one seed and length, appended to `cells`."""
    users = _items(model, rng, long_term, max(settings.batches))
    for batch in settings.batches:
        cell = bench_cell(model, users[:batch], settings, seed, long_term)
        print(
            f"seed {seed} prefix {long_term + USER_FEATURES:5d} B={batch:2d}: singles "
            f"{cell.singles_ms:8.1f} ms, batch {cell.batch_ms:8.1f} ms, "
            f"x{cell.speedup:.2f}, err {cell.max_rel_err:.1e}",
            flush=True,
        )
        cells.append(cell)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    if settings.from_json is not None:
        result = load_result(settings.from_json)
    else:
        result = run(settings, sys.argv[1:] if argv is None else argv)
        settings.output.parent.mkdir(parents=True, exist_ok=True)
        settings.output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {settings.output}")
    # The summary is derived from the cells on every render, so a saved result re-renders
    # with the current summary rules.
    result["summary"] = summarise(result["cells"], result["matmul_peak"]["gflops_per_s"])
    section = render_section(result)
    print(section)
    if settings.docs is not None and not (settings.from_json is not None and result["quick"]):
        write_section(settings.docs, (settings.from_json or settings.output).stem, section)
        print(f"updated {settings.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
