"""Cached Ranks through the ranker's engine, batched across requests vs one model call each.

bench/batch_bench.py times the model alone (B Ranks as one `rank_batch` call vs B `rank` calls);
this drives the service's own driver, a `RankerEngine` built as the server builds it
(`build_engine` from a `RankerConfig`), in this process with the real default model on the CPU.
Two configurations differ only in `max_batch_requests`: 1 (unbatched, every Rank its own call)
and the default (batched: the Ranks queued when the worker frees share its next call).

Per seed and prefix length, U users' prefixes are pre-inferred through each engine (untimed),
then Ranks consuming them, each with its own short-term behaviours and candidates, are offered:

- saturation: a closed loop keeps K Ranks outstanding; after warm-up Ranks, N are timed, giving
  throughput (N over their wall time) and per-Rank latency (offered to answered);
- low load: an open loop of Poisson arrivals at a share of the unbatched saturation throughput
  just measured (or a given rate), the same arrival times for both configurations; latency from
  each Rank's scheduled arrival, so a late start counts against the engine.

The two configurations run back to back in an order that alternates per seed and length (AB,
BA, ...), so drift in machine load hits both alike. Results go to bench/results/ and to a marked
section of docs/benchmarks.md.

    .venv/bin/python bench/engine_batch_bench.py           # 3 seeds, 256/1,024/4,096 tokens
    .venv/bin/python bench/engine_batch_bench.py --quick   # a smoke run (under a minute)
"""

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.batch_bench import LENGTHS, QUICK_LENGTHS, REQUEST_TS, SPEEDUP_TARGET, USER_FEATURES
from bench.model_bench import matmul_peak, matmul_rates, random_behaviours, rank_flops
from bench.pipeline import save_results
from bench.report import add_render_arguments, load_result, machine_info, publish, run_stamp
from bench.verdict import Interval, PairedRatios, p99_interval, verdict_word
from relaygr.behaviours import Prefix, RankInput, UserId
from relaygr.bounds import AT_LEAST_ONE, SHARE, Bound, Bounded
from relaygr.cli_help import HelpFormatter
from relaygr.cost import CostModel
from services.ranker.config import MIB, RankerConfig
from services.ranker.engine import RankerEngine
from services.ranker.model import RankingModel
from services.ranker.model_config import ModelConfig
from services.ranker.outcomes import CacheOutcome
from services.ranker.server import build_engine

ROOT = Path(__file__).resolve().parent.parent
NAME = "engine_batch_bench"  # results file and docs/benchmarks.md section
UNBATCHED, BATCHED = "unbatched", "batched"
SATURATION, LOW_LOAD = "saturation", "low_load"
DEFAULTS = RankerConfig(plaintext=True)  # the shipped batching settings
# The seeds a throughput verdict needs; fewer (a smoke run) is indicative.
MIN_SEEDS = 3
# An unbatched engine at this share of the matmul peak or more leaves a batch little to gain.
BUSY_SHARE = 0.6
# A cached Rank without a deadline is never shed nor recomputed, so the cost model steers
# nothing measured here; these are this CPU's rough figures, not a calibration.
NOMINAL_COST = CostModel(
    fixed_ms=5.0, per_token_ms=0.05, per_pair_ms=1e-6, per_candidate_key_ms=1e-4,
    reload_ms_per_mb=0.1,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Phase:
    """One configuration's Ranks in one phase (saturation or low load) of one seed and length."""

    seed: int
    long_term: int
    variant: str
    phase: str
    ranks: int
    wall_s: float
    offered_per_s: float | None  # low load: the Poisson rate; saturation: none (closed loop)
    calls: int  # scoring model calls the engine made during the phase
    misses: int  # Ranks that did not find their prefix on the device (expected: 0)
    latencies_ms: list[float]

    @property
    def throughput(self) -> float:
        return self.ranks / self.wall_s

    @property
    def mean_batch(self) -> float:
        return self.ranks / self.calls if self.calls else float("nan")


# --------------------------------------------------------------------------------------------
# Workload and engines


def workload(
    cfg: ModelConfig, args: argparse.Namespace, seed: int, long_term: int
) -> tuple[list[Prefix], list[RankInput]]:
    """`args.users` prefixes of `long_term` behaviours and enough Ranks for every phase, each
    for the next user in turn with its own short-term behaviours and candidates."""
    rng = np.random.default_rng([seed, long_term])
    cut = REQUEST_TS - 3_600
    prefixes = [
        Prefix(
            user_id=UserId(f"bench-user-{i}"),
            user_features=rng.integers(0, 1 << 20, size=USER_FEATURES),
            long_term=random_behaviours(cfg, rng, long_term, REQUEST_TS - 2 * 365 * 86_400, cut),
        )
        for i in range(args.users)
    ]
    count = max(args.warmup + args.ranks, args.low_load_ranks)
    ranks = [
        RankInput(
            prefixes[i % len(prefixes)],
            random_behaviours(cfg, rng, args.short_term, cut, REQUEST_TS),
            rng.integers(0, 1 << 40, size=args.candidates),
            REQUEST_TS,
        )
        for i in range(count)
    ]
    return prefixes, ranks


def ranker_config(
    args: argparse.Namespace, cfg: ModelConfig, long_term: int, batch: int
) -> RankerConfig:
    """The ranker's configuration for one variant: every prefix fits on the device, no host
    tier, pins that outlast the run; `batch` Ranks at most per call."""
    need = args.users * (long_term + USER_FEATURES) * cfg.cache_bytes_per_token
    return RankerConfig(
        plaintext=True,
        device="cpu",
        hbm_budget_mb=2 * need / MIB + 64,
        dram_budget_mb=0.0,
        relay_window_ms=DEFAULTS.max_relay_window_ms,
        max_batch_requests=batch,
        max_batch_rows=args.max_batch_rows,
    )


def _calls(engine: RankerEngine) -> int:
    return engine.stats().batch_requests.count


def _misses(outcomes: Sequence[CacheOutcome]) -> int:
    return sum(1 for o in outcomes if o is not CacheOutcome.HBM_HIT)


async def saturate(
    engine: RankerEngine, ranks: Sequence[RankInput], outstanding: int
) -> tuple[float, list[float], list[CacheOutcome]]:
    """A closed loop: `outstanding` Ranks in flight until every one of `ranks` is answered.
    Returns the wall seconds, each Rank's latency (ms, offered to answered) and outcome."""
    latencies: list[float] = [0.0] * len(ranks)
    outcomes: list[CacheOutcome] = [CacheOutcome.MISS] * len(ranks)
    following = iter(range(len(ranks)))

    async def client() -> None:
        for i in following:  # shared: each client takes the next Rank not yet offered
            start = time.perf_counter()
            result = await engine.rank(ranks[i], None)
            latencies[i] = (time.perf_counter() - start) * 1e3
            outcomes[i] = result.outcome

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(outstanding)))
    return time.perf_counter() - start, latencies, outcomes


async def open_loop(
    engine: RankerEngine, ranks: Sequence[RankInput], arrivals_s: Sequence[float]
) -> tuple[float, list[float], list[CacheOutcome]]:
    """Rank i offered at `arrivals_s[i]` from the start whatever is outstanding. Latency runs
    from the scheduled arrival (a Rank offered late has waited all the same)."""
    latencies: list[float] = [0.0] * len(arrivals_s)
    outcomes: list[CacheOutcome] = [CacheOutcome.MISS] * len(arrivals_s)
    start = time.perf_counter()

    async def one(i: int) -> None:
        result = await engine.rank(ranks[i], None)
        latencies[i] = (time.perf_counter() - start - arrivals_s[i]) * 1e3
        outcomes[i] = result.outcome

    tasks = []
    for i, due in enumerate(arrivals_s):
        delay = start + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - start, latencies, outcomes


# --------------------------------------------------------------------------------------------
# One seed and length


async def run_length(
    model: RankingModel, args: argparse.Namespace, seed: int, long_term: int, batched_first: bool
) -> list[Phase]:
    """Both configurations at one seed and prefix length: saturation, then low load, each in
    the order given."""
    prefixes, ranks = workload(model.cfg, args, seed, long_term)
    batches = {UNBATCHED: 1, BATCHED: args.max_batch}
    order = [BATCHED, UNBATCHED] if batched_first else [UNBATCHED, BATCHED]
    engines: dict[str, RankerEngine] = {}
    for variant in order:
        engine = build_engine(
            ranker_config(args, model.cfg, long_term, batches[variant]), model, NOMINAL_COST
        )
        for prefix in prefixes:  # untimed: every Rank below finds its prefix cached
            await engine.pre_infer(prefix, None, None)
        engines[variant] = engine
    phases: list[Phase] = []

    def phase(
        variant: str, name: str, calls: int, rate: float | None,
        ran: tuple[float, list[float], list[CacheOutcome]],
    ) -> Phase:  # fmt: skip
        wall_s, latencies, outcomes = ran
        done = Phase(
            seed, long_term, variant, name, len(latencies), wall_s, rate,
            _calls(engines[variant]) - calls, _misses(outcomes),
            [round(ms, 2) for ms in latencies],
        )  # fmt: skip
        phases.append(done)
        p99 = float(np.percentile(latencies, 99))
        print(
            f"seed {seed} prefix {long_term + USER_FEATURES:5d} {name:10s} {variant:9s}: "
            f"{done.throughput:6.1f} Ranks/s, P99 {p99:7.1f} ms, mean batch "
            f"{done.mean_batch:.2f}, misses {done.misses}"
            + ("" if rate is None else f" (offered {rate:.1f} Ranks/s)"),
            flush=True,
        )
        return done

    timed = ranks[args.warmup : args.warmup + args.ranks]
    for variant in order:
        engine = engines[variant]
        await saturate(engine, ranks[: args.warmup], args.outstanding)
        calls = _calls(engine)
        phase(variant, SATURATION, calls, None, await saturate(engine, timed, args.outstanding))
    unbatched = next(p for p in phases if p.variant == UNBATCHED)
    rate = args.low_load_rate or args.low_load_share * unbatched.throughput
    gaps = np.random.default_rng([seed, long_term, 1]).exponential(1 / rate, args.low_load_ranks)
    arrivals = np.cumsum(gaps).tolist()
    for variant in order:
        engine = engines[variant]
        calls = _calls(engine)
        phase(variant, LOW_LOAD, calls, rate, await open_loop(engine, ranks, arrivals))
    for engine in engines.values():
        await engine.close()
    return phases


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    started = machine_info(args.threads)  # stamped at the start: the code that ran
    begun = time.perf_counter()
    load_before = os.getloadavg()
    seeds = [args.seed + k for k in range(args.seeds)]
    print(f"seeds {seeds} (--seed {args.seed}), {args.threads} torch thread(s)", flush=True)
    sizes, tries = ((1024,), 3) if args.quick else ((1024, 2048), 5)
    before = matmul_rates(sizes, tries, args.seed)
    cfg = ModelConfig()
    results: dict[str, Any] = {
        "quick": args.quick,
        "seeds": seeds,
        "config": cfg.to_dict(),
        "workload": {
            "user_features": USER_FEATURES,
            "long_term": list(args.lengths),
            "short_term": args.short_term,
            "candidates": args.candidates,
            "users": args.users,
            "outstanding": args.outstanding,
            "warmup": args.warmup,
            "ranks": args.ranks,
            "low_load_ranks": args.low_load_ranks,
            "low_load_share": args.low_load_share,
            "low_load_rate": args.low_load_rate,
            "max_batch": args.max_batch,
            "max_batch_rows": args.max_batch_rows,
        },
        "flops_per_rank": {
            str(n): rank_flops(cfg, n + USER_FEATURES, args.short_term, args.candidates)
            for n in args.lengths
        },
        "targets": {"throughput_ratio": SPEEDUP_TARGET},
        "phases": [],
    }
    for k, seed in enumerate(seeds):
        torch.manual_seed(seed)
        model = RankingModel(cfg, seed=seed)
        for j, long_term in enumerate(args.lengths):
            phases = asyncio.run(run_length(model, args, seed, long_term, (k + j) % 2 == 1))
            results["phases"] += [asdict(p) for p in phases]
        # Saved after each seed (a run cut short keeps what it measured), stamped at the start.
        results["matmul_peak"] = matmul_peak(before, before, tries)
        results["load_average_1m"] = {"start": load_before[0], "end": os.getloadavg()[0]}
        results["wall_s"] = time.perf_counter() - begun
        save_results(NAME, args, results, started)
    after = matmul_rates(sizes, tries, args.seed + 1)
    results["matmul_peak"] = matmul_peak(before, after, tries)
    results["wall_s"] = time.perf_counter() - begun
    return save_results(NAME, args, results, started)


# --------------------------------------------------------------------------------------------
# Summary and report


@dataclass(frozen=True, slots=True)
class LengthSummary:
    """One prefix length over every seed: per-seed throughputs, pooled latencies."""

    long_term: int
    throughput: dict[str, dict[int, float]]  # variant -> seed -> Ranks/s at saturation
    ratio: PairedRatios  # batched over unbatched throughput, per seed
    p99: dict[tuple[str, str], Interval]  # (phase, variant) -> P99 of every seed's Ranks
    mean_batch: dict[tuple[str, str], float]  # (phase, variant) -> Ranks per model call
    peak_share: dict[str, float]  # variant -> median over seeds of the saturation share
    low_rate: list[float]  # the low-load rate of each seed
    misses: int


def summarise(saved: dict[str, Any]) -> list[LengthSummary]:
    phases = [Phase(**p) for p in saved["phases"]]
    peak = saved["matmul_peak"]["gflops_per_s"]
    out = []
    for long_term in sorted({p.long_term for p in phases}):
        at = [p for p in phases if p.long_term == long_term]

        def of(phase: str, variant: str, at: list[Phase] = at) -> list[Phase]:
            return [p for p in at if p.phase == phase and p.variant == variant]

        keys = [(ph, v) for ph in (SATURATION, LOW_LOAD) for v in (UNBATCHED, BATCHED)]
        throughput = {
            v: {p.seed: p.throughput for p in of(SATURATION, v)} for v in (UNBATCHED, BATCHED)
        }
        flops = saved["flops_per_rank"][str(long_term)]
        out.append(
            LengthSummary(
                long_term=long_term,
                throughput=throughput,
                ratio=PairedRatios.of(throughput[BATCHED], throughput[UNBATCHED]),
                p99={
                    key: p99_interval([ms for p in of(*key) for ms in p.latencies_ms])
                    for key in keys
                },
                mean_batch={
                    key: sum(p.ranks for p in of(*key)) / max(1, sum(p.calls for p in of(*key)))
                    for key in keys
                },
                peak_share={
                    v: statistics.median(t * flops / 1e9 / peak for t in by_seed.values())
                    for v, by_seed in throughput.items()
                },
                low_rate=[p.offered_per_s or 0.0 for p in of(LOW_LOAD, UNBATCHED)],
                misses=sum(p.misses for p in at),
            )
        )
    return out


def _spread(values: Sequence[float], fmt: str = ".1f") -> str:
    """Median [range] over seeds; one value when they agree."""
    mid = statistics.median(values)
    if min(values) == max(values):
        return f"{mid:{fmt}}"
    return f"{mid:{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _duration(seconds: float) -> str:
    return f"about {seconds:.0f} s" if seconds < 120 else f"about {seconds / 60:.0f} minutes"


def _met(passed: bool, n: int, minimum: int, unit: str) -> str:
    """verdict_word's wording, pass and fail read as met and not met."""
    word = verdict_word(passed, n, minimum, unit)
    return {"pass": "met", "fail": "not met"}.get(word, word)


def _tokens(s: LengthSummary) -> str:
    return f"{s.long_term + USER_FEATURES:,}"


def no_worse(s: LengthSummary) -> bool:
    """The batched low-load P99 is at most the unbatched one's upper 95% bound: batching is
    not seen to cost P99 beyond what the unbatched run's own sampling spread allows."""
    return s.p99[LOW_LOAD, BATCHED].value <= s.p99[LOW_LOAD, UNBATCHED].high


def verdicts(summary: Sequence[LengthSummary], seeds: int) -> list[str]:
    """The issue's two targets, each one line over every length, then what disappoints."""
    ratio_met = all(s.ratio.median.value >= SPEEDUP_TARGET for s in summary)
    ratio_figures = "; ".join(f"{_tokens(s)} tokens {s.ratio.text()}" for s in summary)
    p99_n = min(min(s.p99[LOW_LOAD, v].n for v in (UNBATCHED, BATCHED)) for s in summary)
    p99_figures = "; ".join(
        f"{_tokens(s)} tokens batched {s.p99[LOW_LOAD, BATCHED].text(' ms')} vs unbatched "
        f"{s.p99[LOW_LOAD, UNBATCHED].text(' ms')}"
        for s in summary
    )
    lines = [
        f"- Throughput ratio at least {SPEEDUP_TARGET}x at each length: "
        f"**{_met(ratio_met, seeds, MIN_SEEDS, 'seeds')}** ({ratio_figures}).",
        "- Low-load P99 no worse (batched P99 at most the unbatched P99's upper 95% bound): "
        f"**{_met(all(no_worse(s) for s in summary), p99_n, 300, 'n')}** ({p99_figures}).",
    ]
    for s in summary:
        if s.ratio.median.value < SPEEDUP_TARGET:
            share = s.peak_share[UNBATCHED]
            why = (
                "so on this CPU a call of one cached Rank leaves little for a batch to gain "
                "(bench/batch_bench.py finds the same at the model level)"
                if share >= BUSY_SHARE
                else "so the unbatched calls left the BLAS room that batching did not take"
            )
            lines.append(
                f"- Short of the target at {_tokens(s)} tokens: batching raised throughput "
                f"{s.ratio.median.value:.2f}x, with {s.mean_batch[SATURATION, BATCHED]:.2f} Ranks "
                f"a call; the unbatched engine ran at {share:.0%} of the matmul peak (batched "
                f"{s.peak_share[BATCHED]:.0%}), {why}."
            )
        sat_b, sat_u = s.p99[SATURATION, BATCHED], s.p99[SATURATION, UNBATCHED]
        if sat_b.low > sat_u.high:
            lines.append(
                f"- At {_tokens(s)} tokens batching raised the saturation P99 beyond its "
                f"interval: {sat_b.text(' ms')} vs {sat_u.text(' ms')}."
            )
        if not no_worse(s):
            low_batch = s.mean_batch[LOW_LOAD, BATCHED]
            cause = (
                "every call scored one Rank (mean batch 1.00), the same calls as unbatched, so "
                "the gap is run-to-run spread, not batching"
                if low_batch == 1.0
                else f"its calls averaged {low_batch:.2f} Ranks"
            )
            lines.append(
                f"- At {_tokens(s)} tokens the batched low-load P99 came out above the "
                f"unbatched one's upper bound; {cause}."
            )
    if any(s.misses for s in summary):
        lines.append(
            f"- {sum(s.misses for s in summary)} Rank(s) did not find their prefix on the "
            "device and computed it, so their times are not a cached Rank's."
        )
    return lines


def render(saved: dict[str, Any]) -> str:
    summary = summarise(saved)
    work, machine = saved["workload"], saved["machine"]
    seeds = saved["seeds"]
    peak = saved["matmul_peak"]
    lines = [
        "## Engine: cached Ranks batched across requests, saturation and low load",
        "",
        f"Reproduce: `make bench-engine-batch` (runs `.venv/bin/python bench/{NAME}.py`); this "
        f"run: `{saved['command']}`; {_duration(saved['wall_s'])}.",
        "",
        f"- {run_stamp(machine)}; torch {machine['torch']}, {machine['threads']} torch thread(s).",
        f"- A `RankerEngine` built as the server builds it (`build_engine`), in-process, default "
        f"`ModelConfig()` on the CPU; unbatched: `max_batch_requests` 1; batched: "
        f"`max_batch_requests` {work['max_batch']}, `max_batch_rows` {work['max_batch_rows']}.",
        f"- Per seed and length: {work['users']} users' prefixes ({work['user_features']} user "
        f"features + the long-term behaviours) pre-inferred through each engine, untimed; every "
        f"Rank consumes one, with {work['short_term']} short-term behaviours and "
        f"{work['candidates']} candidates of its own. Seeds {', '.join(map(str, seeds))}; the "
        "two configurations run back to back, their order alternating per seed and length.",
        f"- Saturation: a closed loop of {work['outstanding']} outstanding Ranks; "
        f"{work['warmup']} warm-up Ranks, then {work['ranks']} timed per seed and configuration. "
        "Ranks/s is the timed Ranks over their wall time (median [range] over seeds); the ratio "
        "is batched over unbatched per seed (verdict.py `PairedRatios`); P99s pool every seed's "
        "Ranks, with bootstrap 95% intervals and n; mean batch is Ranks per scoring model call "
        "(the engine's `batch_requests` histogram); % of peak is the Ranks' analytic matmul "
        f"FLOPs (model_bench `rank_flops`) per second over the fp32 matmul peak measured in the "
        f"run, {peak['gflops_per_s']:.1f} GFLOP/s (model_bench's best-of-{peak['tries']}).",
        "- Low load: Poisson arrivals, "
        + (
            f"{work['low_load_rate']:g} Ranks/s"
            if work["low_load_rate"]
            else f"{work['low_load_share']:.0%} of the seed's unbatched saturation throughput"
        )
        + f", {work['low_load_ranks']} Ranks per seed and configuration, the same arrival "
        "times for both; latency from the scheduled arrival.",
        f"- 1-minute load average: {saved['load_average_1m']['start']:.2f} at the start, "
        f"{saved['load_average_1m']['end']:.2f} at the end.",
        "",
        "Saturation:",
        "",
        "| prefix tokens | unbatched Ranks/s | batched Ranks/s | ratio | unbatched P99 ms "
        "| batched P99 ms | mean batch | % of peak (unbatched, batched) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {_tokens(s)} | {_spread(list(s.throughput[UNBATCHED].values()))} "
            f"| {_spread(list(s.throughput[BATCHED].values()))} | {s.ratio.text()} "
            f"| {s.p99[SATURATION, UNBATCHED].text()} | {s.p99[SATURATION, BATCHED].text()} "
            f"| {s.mean_batch[SATURATION, BATCHED]:.2f} "
            f"| {s.peak_share[UNBATCHED]:.0%}, {s.peak_share[BATCHED]:.0%} |"
        )
    lines += [
        "",
        "Low load:",
        "",
        "| prefix tokens | Ranks/s offered | unbatched P99 ms | batched P99 ms | mean batch |",
        "|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {_tokens(s)} | {_spread(s.low_rate)} | {s.p99[LOW_LOAD, UNBATCHED].text()} "
            f"| {s.p99[LOW_LOAD, BATCHED].text()} | {s.mean_batch[LOW_LOAD, BATCHED]:.2f} |"
        )
    lines += ["", *verdicts(summary, len(seeds))]
    if saved["quick"]:
        lines += ["", "A smoke run (`--quick`): too few Ranks and seeds for a verdict."]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line


def _lengths(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(","))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    count = Bounded(int, AT_LEAST_ONE)
    parser.add_argument("--seeds", type=count, default=MIN_SEEDS, help="how many seeds")
    parser.add_argument(
        "--seed", type=int, default=None, help="first seed (default: drawn, and printed)"
    )
    parser.add_argument("--threads", type=count, default=1, help="torch threads")
    parser.add_argument(
        "--lengths",
        type=_lengths,
        default=LENGTHS,
        help="long-term behaviours per prefix, comma-separated (the prefix adds "
        f"{USER_FEATURES} user features)",
    )
    parser.add_argument("--candidates", type=count, default=128, help="candidates per Rank")
    parser.add_argument(
        "--short-term", type=count, default=32, help="short-term behaviours per Rank"
    )
    parser.add_argument(
        "--users", type=count, default=16, help="users (cached prefixes) per seed and length"
    )
    parser.add_argument(
        "--outstanding",
        type=Bounded(int, Bound(low=1, high=DEFAULTS.max_queued_ranks)),
        default=16,
        help="Ranks kept outstanding at saturation",
    )
    parser.add_argument(
        "--warmup", type=count, default=32, help="untimed Ranks before each saturation"
    )
    parser.add_argument("--ranks", type=count, default=400, help="timed Ranks per saturation cell")
    parser.add_argument(
        "--max-batch",
        type=count,
        default=DEFAULTS.max_batch_requests,
        help="the batched configuration's max_batch_requests "
        f"(default: {DEFAULTS.max_batch_requests}, the ranker's)",
    )
    parser.add_argument(
        "--max-batch-rows",
        type=count,
        default=DEFAULTS.max_batch_rows,
        help="both configurations' max_batch_rows "
        f"(default: {DEFAULTS.max_batch_rows}, the ranker's)",
    )
    parser.add_argument(
        "--low-load-share",
        type=Bounded(float, SHARE),
        default=0.2,
        help="low-load rate as a share of the unbatched saturation throughput",
    )
    parser.add_argument(
        "--low-load-rate",
        type=Bounded(float, Bound(low=0, low_open=True)),
        default=None,
        help="low-load rate, Ranks/s (default: none: --low-load-share)",
    )
    parser.add_argument("--low-load-ranks", type=count, default=300, help="Ranks per low-load cell")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: one seed, {QUICK_LENGTHS[0]} behaviours, few Ranks; writes "
        f"bench/results/{NAME}.quick.json and leaves the docs alone",
    )
    parser.add_argument(
        "--tag", default="", help="results and docs section get _TAG (default: none)"
    )
    add_render_arguments(parser)
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little") >> 1
    if args.quick and args.from_json is None:
        args.seeds, args.lengths, args.users = 1, QUICK_LENGTHS, 8
        args.warmup, args.ranks, args.low_load_ranks = 16, 64, 40
        args.no_docs = True
    elif args.from_json is not None and load_result(args.from_json).get("quick"):
        args.no_docs = True  # a smoke run never replaces the measured section
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    name = f"{NAME}_{args.tag}" if args.tag else NAME
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
