"""Open-loop rate sweeps of the full pipeline on a local mesh, shared by the mesh benchmarks."""

import argparse
import copy
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import add_render_arguments, dumps_result, reproduce_command, rotated
from services.ranker.model_config import PRESETS, ModelPreset
from tooling.local.drive import Point, RequestRecord, drive_mesh
from tooling.local.mesh import LocalMesh
from tooling.local.workload import (
    Arrival,
    Follow,
    Population,
    WorkloadSpec,
    follow_ups,
    poisson_arrivals,
)


@dataclass(frozen=True, slots=True)
class Variant:
    """One line of a comparison: a label, the mesh it runs on, the trigger mode it uses."""

    label: str
    mesh: LocalMesh
    mode: str


@dataclass(slots=True)
class Ran:
    """One point as it was driven, for a benchmark that replays it (the simulator's check):
    its arrivals and each one's follow-up (its gap to its Rank, and whether a Rank follows:
    `follow_of`), when it began (`time.monotonic()` just before its trigger mode was set; its
    schedule starts about half a second later) and every record, warm-up included."""

    label: str
    rate: float
    arrivals: list[Arrival]
    follow: Follow
    began: float
    warmup_s: float
    records: list[RequestRecord] = field(default_factory=list)


def follow_of(population: Population, arrivals: Sequence[Arrival]) -> Follow:
    """Each arrival's gap to its Rank and whether a Rank follows at all, as the population's
    spec draws them (`gap_sigma`, `no_show_p`): the same for every variant's copy of a seed's
    trace (`population`), as the arrivals are."""
    gaps, ranked = follow_ups(population.spec, population.seed, len(arrivals))
    return gaps.tolist(), ranked.tolist()


def counted_ranks(population: Population, arrivals: Sequence[Arrival], warmup_s: float) -> int:
    """The Ranks a point of `arrivals` counts: those of retrievals from `warmup_s` on that a
    Rank follows (`follow_of`)."""
    _, ranked = follow_of(population, arrivals)
    return sum(1 for a, r in zip(arrivals, ranked, strict=True) if r and a.at >= warmup_s)


def schedule(
    population: Population, rate: float, duration_s: float, warmup_s: float, min_ranks: int
) -> list[Arrival]:
    """`population`'s open-loop arrivals at `rate` for `duration_s`, or, where that would count
    fewer than `min_ranks` Ranks from `warmup_s` on, for just as much longer as it takes: the
    schedule a run of that longer duration draws, so a P99 verdict gets its sample count
    whatever the draw (a fixed duration counts a random number of Ranks, as likely under its
    mean as over). The population advances as by that one run."""
    span = duration_s
    while min_ranks > 0:
        trial = copy.deepcopy(population)
        short = min_ranks - counted_ranks(trial, poisson_arrivals(trial, rate, span), warmup_s)
        if short <= 0:
            break
        span += short / rate
    return poisson_arrivals(population, rate, span)


def point_schedule(
    population: Population, rate: float, args: argparse.Namespace
) -> tuple[list[Arrival], float]:
    """A point's arrivals at `rate` and the warm-up not counted: max(args.duration,
    args.min_requests / rate) seconds, its first `args.warmup` share the warm-up, run on where
    that counts fewer than `args.min_ranks` Ranks (`schedule`)."""
    duration = max(args.duration, args.min_requests / rate)
    warmup_s = duration * args.warmup
    return schedule(population, rate, duration, warmup_s, args.min_ranks), warmup_s


def run_point(
    variant: Variant,
    population: Population,
    rate: float,
    args: argparse.Namespace,
    ran: list[Ran] | None = None,
) -> Point:
    """One open-loop point at `rate`, as `point_schedule` draws it. `ran`: when given, the
    point's `Ran` is appended to it."""
    arrivals, warmup_s = point_schedule(population, rate, args)
    follow = follow_of(population, arrivals)
    kept = Ran(variant.label, rate, arrivals, follow, time.monotonic(), warmup_s)
    point = drive_mesh(
        variant.mesh,
        variant.mode,
        arrivals,
        label=variant.label,
        rate=rate,
        gap_s=population.spec.gap_s,
        warmup_s=kept.warmup_s,
        timeout_s=args.timeout,
        records=kept.records if ran is not None else None,
        follow=follow,
    )
    if ran is not None:
        ran.append(kept)
    print(
        f"{variant.label:>18} {rate:5g}/s  p50 {point.p50_ms:7.0f}  p99 {point.p99_ms:7.0f} ms  "
        f"n {point.ok}  relayed {point.relayed_ratio:.0%}  cross-visit {point.cached_ratio:.0%}  "
        f"{point.reasons} {point.errors}",
        flush=True,
    )
    return point


def population(label: str, spec: WorkloadSpec, seed: int, suffix: str = "") -> Population:
    """`label`'s copy of the seed's trace: the same draws, user ids of its own (own caches)."""
    user_prefix = f"{label.replace(' ', '-')}-s{seed}{suffix}"
    return Population(replace(spec, user_prefix=user_prefix), np.random.default_rng(seed))


def sweep(
    variants: Sequence[Variant],
    spec: WorkloadSpec,
    args: argparse.Namespace,
    seed: int | None = None,
    stop_ms: float | None = None,
    ran: list[Ran] | None = None,
) -> list[Point]:
    """Rates in order, the variants in rotating order at each rate (drift hits all alike); a
    variant stops once its P99 passes `stop_ms` (default twice the SLO) or a request fails.
    `seed`: the trace's (default args.seed). `ran`: as `run_point`'s."""
    seed = args.seed if seed is None else seed
    stop_ms = 2 * args.slo_ms if stop_ms is None else stop_ms
    pops = {v.label: population(v.label, spec, seed) for v in variants}
    points: list[Point] = []
    saturated: set[str] = set()
    for i, rate in enumerate(args.rates):
        for variant in rotated(variants, i):
            if variant.label in saturated:
                continue
            point = run_point(variant, pops[variant.label], rate, args, ran)
            points.append(point)
            if point.p99_ms > stop_ms or point.errors:
                saturated.add(variant.label)
        if len(saturated) == len(variants):
            break
    return points


ROOT = Path(__file__).resolve().parent.parent
# A lighter model than the default keeps a sweep to minutes on 2 cores (every benchmark's).
BENCH_MODEL = PRESETS[ModelPreset.SMALL]


def add_sweep_arguments(parser: argparse.ArgumentParser, rates: list[float]) -> None:
    """The options every mesh benchmark shares."""
    parser.add_argument(
        "--rates", type=float, nargs="+", default=rates, help="arrival rates swept, per second"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per point")
    parser.add_argument(
        "--min-requests", type=int, default=90, help="low rates run longer to send this many"
    )
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of a point excluded")
    parser.add_argument(
        "--min-ranks",
        type=int,
        default=0,
        help="a point runs on until it counts this many Ranks past the warm-up (0: no minimum;"
        " a P99 verdict needs 300)",
    )
    parser.add_argument("--slo-ms", type=float, default=1500.0, help="ranking P99 budget")
    parser.add_argument(
        "--margin-ms", type=float, default=1400.0, help="at risk: full inference over SLO - margin"
    )
    parser.add_argument("--timeout", type=float, default=20.0, help="per-RPC deadline, seconds")
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=WorkloadSpec().gap_s * 1e3,
        help="retrieval to ranking gap, ms",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=int.from_bytes(os.urandom(4), "little"),
        help="workload seed (default: random)",
    )
    parser.add_argument("--quick", action="store_true", help="two rates, short points")
    add_render_arguments(parser)
    parser.add_argument(
        "--tag", default="", help="a second configuration: results and doc section get _TAG"
    )


def result_name(name: str, args: argparse.Namespace) -> str:
    return f"{name}_{args.tag}" if args.tag else name


def ranker_args(model_path: Path, hbm_mb: int) -> tuple[str, ...]:
    return (
        "--model-config", str(model_path), "--device", "cpu",
        "--hbm-budget-mb", str(hbm_mb), "--dram-budget-mb", str(4 * hbm_mb),
        "--max-queued-ranks", "512",
    )  # fmt: skip


def save_results(
    name: str,
    args: argparse.Namespace,
    results: Mapping[str, object],
    started: dict[str, Any],
    threads: int | None = None,
) -> dict:
    """Write bench/results/<name>[.quick].json with the reproducing command and `started`: the
    stamp (`machine_info`) taken when the run started, never at saving, so that a run saved after
    each seed keeps the commit it measured (a commit made meanwhile is not stamped on it).
    `threads`: the rankers' intra-op threads, when the benchmark learnt them during the run."""
    machine = dict(started)
    if threads is not None:
        machine["threads"] = threads
    saved = {
        "command": reproduce_command(name, args.seed),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine,
        **results,
    }
    out = (
        ROOT
        / "bench"
        / "results"
        / f"{result_name(name, args)}{'.quick' if args.quick else ''}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps_result(saved))
    return saved
