"""Ranking latency of full inference vs cached rank over growing prefixes, on this machine's CPU.

For each long-term prefix length the prefix is prefilled once (untimed), then `full_forward` and
`rank` run interleaved (full, rank, full, rank, ...) after warm-up, so drift in machine load hits
both alike. The analytic FLOPs of the cached rank, divided by its median time, are compared with
this machine's fp32 matmul peak measured in the same run. Results go to JSON and to a marked
section of docs/benchmarks.md.
"""

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.report import add_render_arguments, load_result, machine_info, write_section
from relaygr.behaviours import Behaviours, Prefix, RankInput, UserId
from relaygr.bounds import AT_LEAST_ONE, Bounded
from relaygr.cli_help import HelpFormatter
from services.ranker import synthetic
from services.ranker.model import RankingModel
from services.ranker.model_config import ModelConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
COMMAND = ".venv/bin/python bench/model_bench.py"
FULL_LENGTHS = (512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (512, 1024)
USER_FEATURES = 8
SHORT_TERM = 128
CANDIDATES = 256
MAX_REL_ERR = 1e-5
SPEEDUP_TARGET = 8.0  # cached rank vs full inference at a 4k prefix
SPEEDUP_TARGET_TOKENS = 4096
PEAK_FRACTION_TARGET = 0.5  # cached rank's achieved rate vs the measured matmul peak
NOISE_RATIO = 2.0  # P99 / median above which a row counts as disturbed by foreign load
SECTION = "model_bench"  # docs/benchmarks.md section, between <!-- model_bench:start/end -->
REQUEST_TS = 1_700_000_000


@dataclass(frozen=True, slots=True)
class Settings:
    """What one bench run measures; built once from the command line."""

    seed: int
    threads: int
    quick: bool
    lengths: tuple[int, ...]
    repeats: int | None  # fixed timed pairs per length; None: fit `budget_s`
    budget_s: float  # per-length timing budget when `repeats` is None
    min_repeats: int
    max_repeats: int
    warmup: int
    peak_sizes: tuple[int, ...]
    peak_tries: int
    output: Path
    docs: Path | None
    from_json: Path | None  # re-render this saved result instead of running


@dataclass(frozen=True, slots=True)
class Row:
    """Measurements at one prefix length; times in milliseconds."""

    long_term: int
    prefix_tokens: int
    repeats: int
    full_median_ms: float
    full_p99_ms: float
    rank_median_ms: float
    rank_p99_ms: float
    speedup: float
    kv_bytes: int
    rank_flops: int
    full_flops: int
    rank_gflops_per_s: float
    full_gflops_per_s: float
    max_rel_err: float


# --------------------------------------------------------------------------------------------
# Analytic FLOPs (matmuls only, 2*m*n*k each)


def _pointwise_flops(cfg: ModelConfig) -> tuple[int, int]:
    """(uvqk projection, out projection + FFN) FLOPs of one token at one layer."""
    d, h = cfg.d_model, cfg.num_heads
    uvqk = 2 * d * h * (2 * cfg.d_v + 2 * cfg.d_qk)
    rest = 2 * h * cfg.d_v * d + 2 * 2 * d * cfg.ffn_mult * d
    return uvqk, rest


def _pair_flops(cfg: ModelConfig) -> int:
    """Attention FLOPs of one (query, key) pair over all heads: QK^T plus AV."""
    return cfg.num_heads * (2 * cfg.d_qk + 2 * cfg.d_v)


def _candidate_flops(cfg: ModelConfig, history: int, candidates: int) -> int:
    """Candidates at every layer over `history` keys (self-attention term neglected), plus head."""
    uvqk, rest = _pointwise_flops(cfg)
    per_layer = candidates * (uvqk + _pair_flops(cfg) * history + rest)
    return cfg.num_layers * per_layer + 2 * candidates * cfg.d_model * len(cfg.tasks)


def rank_flops(cfg: ModelConfig, prefix: int, short: int, candidates: int) -> int:
    """Matmul FLOPs of `rank` with `prefix` cached tokens, `short` short-term, `candidates`.

    Short-term tokens are one query block: at layers 0..L-2 they attend to all prefix + short
    keys (the diagonal block is computed whole, then masked); at the last layer they only
    project (their K/V feed the candidates, their outputs nothing).
    """
    uvqk, rest = _pointwise_flops(cfg)
    history = prefix + short
    hidden_layers = cfg.num_layers - 1
    short_flops = hidden_layers * short * (uvqk + _pair_flops(cfg) * history + rest) + short * uvqk
    return short_flops + _candidate_flops(cfg, history, candidates)


def full_flops(cfg: ModelConfig, history: int, candidates: int) -> int:
    """Matmul FLOPs of `full_forward` over `history` tokens, as the model runs it.

    History runs in query blocks of `attention_block` rows; a block attends to every key up to
    its own last row (the diagonal square whole), so pairs are rows * stop per block.
    """
    uvqk, rest = _pointwise_flops(cfg)
    block = cfg.attention_block
    pairs = sum(min(block, history - s) * min(s + block, history) for s in range(0, history, block))
    hidden_layers = cfg.num_layers - 1
    history_flops = (
        hidden_layers * (history * (uvqk + rest) + _pair_flops(cfg) * pairs) + history * uvqk
    )
    return history_flops + _candidate_flops(cfg, history, candidates)


# --------------------------------------------------------------------------------------------
# Inputs and timing


def random_behaviours(
    cfg: ModelConfig, rng: np.random.Generator, count: int, start_ts: int, end_ts: int
) -> Behaviours:
    """`count` behaviours with random items and actions, timestamps sorted in [start, end)."""
    return synthetic.random_behaviours(rng, count, start_ts, end_ts - start_ts, cfg.num_actions)


def random_request(cfg: ModelConfig, rng: np.random.Generator, long_term: int) -> RankInput:
    """A request with `long_term` old behaviours, SHORT_TERM recent ones and CANDIDATES items."""
    cut = REQUEST_TS - 3_600
    prefix = Prefix(
        user_id=UserId("bench-user"),
        user_features=rng.integers(0, 1 << 20, size=USER_FEATURES),
        long_term=random_behaviours(cfg, rng, long_term, REQUEST_TS - 2 * 365 * 86_400, cut),
    )
    short = random_behaviours(cfg, rng, SHORT_TERM, cut, REQUEST_TS)
    candidates = rng.integers(0, 1 << 40, size=CANDIDATES)
    return RankInput(prefix, short, candidates, REQUEST_TS)


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for `device`'s queued work: a timer reads the clock only after it, since an
    accelerator runs kernels asynchronously. A no-op on the CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "npu":
        return lambda: torch.npu.synchronize(device)  # type: ignore[attr-defined]
    return lambda: None


def no_sync() -> None:
    pass


def seconds(fn: Callable[[], object], sync: Callable[[], None] = no_sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def time_interleaved(
    first: Callable[[], object], second: Callable[[], object], warmup: int, repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds of `repeats` alternating runs of `first` and `second`, after `warmup` pairs."""
    for _ in range(warmup):
        first()
        second()
    times_first: list[float] = []
    times_second: list[float] = []
    for _ in range(repeats):
        times_first.append(seconds(first))
        times_second.append(seconds(second))
    return times_first, times_second


def fit_repeats(pair_s: float, budget_s: float, low: int, high: int) -> int:
    """Timed pairs that fit `budget_s` when one pair takes `pair_s`, clamped to [low, high]."""
    return max(low, min(high, int(budget_s / max(pair_s, 1e-9))))


def p99(samples: Sequence[float]) -> float:
    """Nearest-rank P99; with fewer than 100 samples this is the maximum."""
    ordered = sorted(samples)
    rank = max(1, int(np.ceil(0.99 * len(ordered))))
    return ordered[rank - 1]


def max_rel_err(full: torch.Tensor, cached: torch.Tensor) -> float:
    return float((full - cached).abs().max() / full.abs().max())


CPU = torch.device("cpu")


def best_mmseconds(
    n: int,
    tries: int,
    generator: torch.Generator,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Fastest of `tries` products of two random n x n matrices of `dtype` on `device`, after
    one warm-up."""
    a = torch.randn(n, n, generator=generator).to(device, dtype)
    b = torch.randn(n, n, generator=generator).to(device, dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: the first call allocates and packs
    sync = device_sync(device)
    return min(seconds(lambda: torch.mm(a, b, out=out), sync) for _ in range(tries))


def matmul_rates(
    sizes: Sequence[int],
    tries: int,
    seed: int,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Best-of-`tries` `torch.mm` GFLOP/s (2n^3/t) per square size (fp32 on the CPU unless
    told otherwise)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        str(n): 2 * n**3 / best_mmseconds(n, tries, generator, device, dtype) / 1e9 for n in sizes
    }


def matmul_peak(before: dict[str, float], after: dict[str, float], tries: int) -> dict[str, Any]:
    """The peak from rates measured before and after the rows: the best of either, per size.

    Measuring twice keeps a burst of foreign load during one measurement from lowering the
    peak (and so from inflating the rank's share of it).
    """
    per_size = {n: max(before[n], after[n]) for n in before}
    return {
        "gflops_per_s": max(per_size.values()),
        "per_size": per_size,
        "before": before,
        "after": after,
        "tries": tries,
    }


def row_record(row: Row, peak: float) -> dict[str, Any]:
    """`row` as a JSON record, with the rank's achieved rate as a fraction of `peak`."""
    return {**asdict(row), "rank_peak_fraction": row.rank_gflops_per_s / peak}


def bench_length(
    model: RankingModel, settings: Settings, rng: np.random.Generator, long_term: int
) -> Row:
    """Prefill once, check exactness, then time full and cached rank interleaved."""
    cfg = model.cfg
    request = random_request(cfg, rng, long_term)
    kv = model.prefill(request.prefix)

    def full() -> torch.Tensor:
        return model.full_forward(request)

    def cached() -> torch.Tensor:
        return model.rank(kv, request.short_term, request.candidates, request.request_ts)

    error = max_rel_err(full(), cached())
    repeats = settings.repeats
    if repeats is None:
        # The check above was a first pair; a second one estimates the steady pair time.
        pair_s = seconds(full) + seconds(cached)
        repeats = fit_repeats(pair_s, settings.budget_s, settings.min_repeats, settings.max_repeats)
    full_s, rank_s = time_interleaved(full, cached, settings.warmup, repeats)
    prefix_tokens = kv.num_tokens
    flops_rank = rank_flops(cfg, prefix_tokens, SHORT_TERM, CANDIDATES)
    flops_full = full_flops(cfg, prefix_tokens + SHORT_TERM, CANDIDATES)
    rank_median, full_median = statistics.median(rank_s), statistics.median(full_s)
    return Row(
        long_term=long_term,
        prefix_tokens=prefix_tokens,
        repeats=repeats,
        full_median_ms=full_median * 1e3,
        full_p99_ms=p99(full_s) * 1e3,
        rank_median_ms=rank_median * 1e3,
        rank_p99_ms=p99(rank_s) * 1e3,
        speedup=full_median / rank_median,
        kv_bytes=kv.nbytes,
        rank_flops=flops_rank,
        full_flops=flops_full,
        rank_gflops_per_s=flops_rank / rank_median / 1e9,
        full_gflops_per_s=flops_full / full_median / 1e9,
        max_rel_err=error,
    )


# --------------------------------------------------------------------------------------------
# Machine, report and docs


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def _span(rows: Sequence[dict[str, Any]]) -> str:
    low, high = min(r["repeats"] for r in rows), max(r["repeats"] for r in rows)
    return str(low) if low == high else f"{low}-{high}"


def render_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    header = (
        "| prefix tokens | full median ms | full P99 ms | rank median ms | rank P99 ms | speed-up "
        "| KV MB/user | rank GFLOP | rank GFLOP/s | % of matmul peak | max rel err |"
    )
    lines = [header, "|" + "---:|" * 11]
    for r in rows:
        lines.append(
            f"| {r['prefix_tokens']} | {r['full_median_ms']:.1f} | {r['full_p99_ms']:.1f} "
            f"| {r['rank_median_ms']:.1f} | {r['rank_p99_ms']:.1f} | {r['speedup']:.1f}x "
            f"| {_mb(r['kv_bytes'])} | {r['rank_flops'] / 1e9:.2f} "
            f"| {r['rank_gflops_per_s']:.1f} | {100 * r['rank_peak_fraction']:.0f}% "
            f"| {r['max_rel_err']:.1e} |"
        )
    return lines


def is_disturbed(row: dict[str, Any]) -> bool:
    """Whether foreign load visibly hit a row: a tail far above the median on either path."""
    return (
        row["full_p99_ms"] > NOISE_RATIO * row["full_median_ms"]
        or row["rank_p99_ms"] > NOISE_RATIO * row["rank_median_ms"]
    )


def _speedup_sentence(cfg: ModelConfig, row: dict[str, Any]) -> str:
    flop_ratio = row["full_flops"] / row["rank_flops"]
    fixed = rank_flops(cfg, 0, SHORT_TERM, CANDIDATES)
    met = "meets" if row["speedup"] >= SPEEDUP_TARGET else "misses"
    return (
        f"At a {row['prefix_tokens']}-token prefix the cached rank is {row['speedup']:.1f}x "
        f"faster than full inference, which {met} the {SPEEDUP_TARGET:.0f}x target. Saving "
        f"FLOPs alone gives {flop_ratio:.1f}x there: {fixed / 1e9:.1f} of the rank's "
        f"{row['rank_flops'] / 1e9:.1f} GFLOP do not depend on the prefix (projections and FFN "
        f"of the {SHORT_TERM} short-term and {CANDIDATES} candidate tokens), so caching cannot "
        "remove them; the rest of the speed-up (or shortfall) is the achieved rates, full "
        f"{row['full_gflops_per_s']:.0f} vs rank {row['rank_gflops_per_s']:.0f} GFLOP/s."
    )


def _peak_sentence(cfg: ModelConfig, rows: Sequence[dict[str, Any]], peak: dict[str, Any]) -> str:
    fractions = [r["rank_peak_fraction"] for r in rows]
    missed = [r["prefix_tokens"] for r in rows if r["rank_peak_fraction"] < PEAK_FRACTION_TARGET]
    verdict = (
        "meets the target at every length"
        if not missed
        else f"misses it at {', '.join(map(str, missed))} prefix tokens"
    )
    spread = [*peak["before"].values(), *peak["after"].values()]
    first, last = fractions[0], fractions[-1]
    trend = ", which is why the share is lower at the longest prefix" if last < first else ""
    return (
        f"The cached rank runs at {100 * min(fractions):.0f}-{100 * max(fractions):.0f}% of the "
        f"measured {peak['gflops_per_s']:.0f} GFLOP/s matmul peak (target "
        f"{100 * PEAK_FRACTION_TARGET:.0f}%), so it {verdict}; the peak measurements themselves "
        f"spread over {min(spread):.0f}-{max(spread):.0f} GFLOP/s on this shared machine. Short "
        f"prefixes are dominated by the linear layers of the {CANDIDATES} candidate and "
        f"{SHORT_TERM} short-term tokens (matmuls with few rows); as the prefix grows, attention "
        f"over it takes over, whose QK^T has an inner dimension of only d_qk = {cfg.d_qk} and "
        "whose score matrices get element-wise passes (bias add, SiLU, time-bias gather) that "
        "count no FLOPs" + trend + "."
    )


def interpret(result: dict[str, Any]) -> str:
    """A few sentences judging the run against the speed-up and peak targets."""
    rows = result["rows"]
    cfg = ModelConfig.from_dict(result["config"])
    sentences: list[str] = [
        _speedup_sentence(cfg, r) for r in rows if r["long_term"] == SPEEDUP_TARGET_TOKENS
    ]
    sentences.append(_peak_sentence(cfg, rows, result["matmul_peak"]))
    noisy = [r["prefix_tokens"] for r in rows if is_disturbed(r)]
    if noisy:
        sentences.append(
            f"Rows {noisy} have a P99 over {NOISE_RATIO:.0f}x their median: other load on the "
            "shared machine hit some samples, so their medians are less reliable."
        )
    worst_err = max(r["max_rel_err"] for r in rows)
    sentences.append(
        f"{'Every row is exact' if worst_err <= MAX_REL_ERR else 'EXACTNESS VIOLATED'}: cached "
        f"and full scores agree to {worst_err:.1e} relative error (bound {MAX_REL_ERR:.0e})."
    )
    return " ".join(sentences)


def render_section(result: dict[str, Any]) -> str:
    cfg, machine = result["config"], result["machine"]
    ffn = f"FFN x{cfg['ffn_mult']}" if cfg["ffn_mult"] else "no FFN"
    lines = [
        "## Model: full inference vs cached rank",
        "",
        f"Reproduce: `make bench-model` (runs `{result['command']}`); this run used seed "
        f"{result['seed']}, i.e. `{COMMAND} --seed {result['seed']}"
        f" --threads {machine['threads']}`.",
        "",
        f"- Date: {machine['date']}; commit: {machine['commit']}",
        f"- Machine: {machine['machine']}, {machine['threads']} torch threads, "
        f"torch {machine['torch']}, Python {machine['python']}",
        f"- Model: default `ModelConfig()`: {cfg['num_layers']} layers, d_model "
        f"{cfg['d_model']}, {cfg['num_heads']} heads (d_qk {cfg['d_qk']}, d_v {cfg['d_v']}), "
        f"{ffn}, {len(cfg['tasks'])} tasks, attention block {cfg['attention_block']}, "
        f"KV {cfg['kv_dtype']}",
        f"- Request: {USER_FEATURES} user-feature tokens + long-term prefix, {SHORT_TERM} "
        f"short-term behaviours, {CANDIDATES} candidates; prefill untimed; full and rank timed "
        f"interleaved after warm-up. P99 is nearest-rank over {_span(result['rows'])} samples "
        "per row, so it is the maximum of those samples.",
        f"- Measured fp32 matmul peak (best-of-{result['matmul_peak']['tries']} `torch.mm`, "
        "2n^3/t, best of a measurement before and one after the rows): "
        + _rates(result["matmul_peak"]["per_size"])
        + f" GFLOP/s; peak {result['matmul_peak']['gflops_per_s']:.1f} GFLOP/s.",
        f"- 1-minute load average: {result['load_average_1m']['start']:.2f} at the start, "
        f"{result['load_average_1m']['end']:.2f} at the end (the bench itself adds about "
        f"{machine['threads']}).",
        "- Rank GFLOP counts matmuls only (2mnk): projections, attention QK^T and AV, FFN, head.",
        "",
        *render_table(result["rows"]),
        "",
        interpret(result),
    ]
    return "\n".join(lines)


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Command line


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(
        description="Full inference vs cached rank latency of the default ranking model.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: random)")
    parser.add_argument(
        "--threads",
        type=Bounded(int, AT_LEAST_ONE),
        default=default_threads(),
        help="torch threads (default: cores)",
    )
    parser.add_argument(
        "--repeats",
        type=Bounded(int, AT_LEAST_ONE),
        default=None,
        help="timed full+rank pairs per length (default: fit --budget-s, between 5 and 30)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=20.0, help="timing budget per length (default: 20)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed pairs per length")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: lengths 512 and 1024, 3 repeats, small peak test; writes "
        "bench/results/model_bench.quick.json and leaves the docs alone",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON result path (default: bench/results/model_bench[.quick].json)",
    )
    parser.add_argument(
        "--docs", type=Path, default=None, help="Markdown to update (default: docs/benchmarks.md)"
    )
    add_render_arguments(parser)
    args = parser.parse_args(argv)
    results = REPO_ROOT / "bench" / "results"
    quick = bool(args.quick)
    default_output = results / ("model_bench.quick.json" if quick else "model_bench.json")
    skip_docs = args.no_docs or (quick and args.docs is None)
    docs = None if skip_docs else (args.docs or REPO_ROOT / "docs" / "benchmarks.md")
    return Settings(
        seed=args.seed if args.seed is not None else secrets.randbits(31),
        threads=args.threads,
        quick=quick,
        lengths=QUICK_LENGTHS if quick else FULL_LENGTHS,
        repeats=3 if quick and args.repeats is None else args.repeats,
        budget_s=args.budget_s,
        min_repeats=5,
        max_repeats=30,
        warmup=1 if quick else args.warmup,
        peak_sizes=(1024, 2048) if quick else (1024, 2048, 4096),
        peak_tries=3 if quick else 5,
        output=args.output or default_output,
        docs=docs,
        from_json=args.from_json,
    )


def _rates(rates: dict[str, float]) -> str:
    return ", ".join(f"n={n}: {rate:.1f}" for n, rate in rates.items())


def run(settings: Settings) -> dict[str, Any]:
    started = machine_info(settings.threads)  # the commit this run measures, stamped before it runs
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    print(f"seed {settings.seed}, {settings.threads} threads", flush=True)
    load_before = os.getloadavg()
    before = matmul_rates(settings.peak_sizes, settings.peak_tries, settings.seed)
    print(f"matmul GFLOP/s before: {_rates(before)}", flush=True)
    cfg = ModelConfig()
    model = RankingModel(cfg, seed=settings.seed)
    rng = np.random.default_rng(settings.seed)
    rows: list[Row] = []
    for length in settings.lengths:
        row = bench_length(model, settings, rng, length)
        print(
            f"prefix {row.prefix_tokens:5d}: full {row.full_median_ms:8.1f} ms "
            f"(p99 {row.full_p99_ms:8.1f}), rank {row.rank_median_ms:7.1f} ms "
            f"(p99 {row.rank_p99_ms:7.1f}), x{row.speedup:4.1f}, "
            f"rank {row.rank_gflops_per_s:6.1f} GFLOP/s, err {row.max_rel_err:.1e}, "
            f"n={row.repeats}",
            flush=True,
        )
        rows.append(row)
    after = matmul_rates(settings.peak_sizes, settings.peak_tries, settings.seed + 1)
    print(f"matmul GFLOP/s after: {_rates(after)}", flush=True)
    peak = matmul_peak(before, after, settings.peak_tries)
    return {
        "command": COMMAND,
        "quick": settings.quick,
        "seed": settings.seed,
        "machine": started,
        "config": cfg.to_dict(),
        "workload": {
            "user_features": USER_FEATURES,
            "short_term": SHORT_TERM,
            "candidates": CANDIDATES,
            "long_term": list(settings.lengths),
        },
        "matmul_peak": peak,
        "load_average_1m": {"start": load_before[0], "end": os.getloadavg()[0]},
        "targets": {
            "speedup_at_4k": SPEEDUP_TARGET,
            "rank_peak_fraction": PEAK_FRACTION_TARGET,
            "max_rel_err": MAX_REL_ERR,
        },
        "rows": [row_record(r, peak["gflops_per_s"]) for r in rows],
    }


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    if settings.from_json is not None:
        result = load_result(settings.from_json)
    else:
        result = run(settings)
        write_json(settings.output, result)
        print(f"wrote {settings.output}")
    section = render_section(result)
    print(section)
    # A run's --quick already chose the docs; a re-rendered smoke run never replaces a real one.
    if settings.docs is not None and not (settings.from_json is not None and result["quick"]):
        write_section(settings.docs, SECTION, section)
        print(f"updated {settings.docs}")
    bad = [r for r in result["rows"] if r["max_rel_err"] > MAX_REL_ERR]
    if bad:
        print(f"exactness bound {MAX_REL_ERR} exceeded at {[r['prefix_tokens'] for r in bad]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
