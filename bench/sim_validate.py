"""The simulator against the real mesh: one seeded trace through both, point by point.

Per seed, fresh local meshes as the relay benchmark starts them (etcd, two CPU rankers, router,
trigger; its model, flags and defaults) for `cache only` and `relay sequence-aware`. Each
mesh's measured profile is the mean of its rankers' Describe (tooling.sim.measured), read once
they have calibrated and before any traffic. The rate sweep runs on the real meshes (the relay
benchmark's sweep: variants rotating at each rate; here every rate is run, so every point has
a twin). A mesh's request overhead is the median, over its first point's answered Ranks, of
the client's latency minus the ranker's own time (RankReply.server_ms). Then each variant's
points go through the simulator (tooling.sim.fleet): the very same arrivals (visits_of), each
point at its real offset from the variant's first (caches and the trigger's books carry over
as they did), with the measured profile and the services' configurations parsed from the
mesh's own flags. Compared per point: P50 and P99 (target: within 15%), hit rate and relayed
share of answered Ranks (within 3 points); per variant, SLO-compliant throughput
(report.max_compliant; within one step of the rate grid).

With --mesh-runs 2, the real sweep runs twice per seed, each time on fresh meshes over the same
trace, and the simulator replays the first: the fidelity verdict (`fidelity`) sets the
simulator's P50, P90 and P99 beside the spread between the two real runs. Each point is
simulated twice: given the start-up calibration, and given the cost model the rankers refitted
to their served work (`compare_variant`); each twin gets its own verdict.

    .venv/bin/python bench/sim_validate.py            # about 10 minutes on 2 cores
    .venv/bin/python bench/sim_validate.py --quick    # smoke run, results not recorded in docs
"""

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from bench.pipeline import (
    BENCH_MODEL,
    ROOT,
    Ran,
    Variant,
    add_sweep_arguments,
    result_name,
    save_results,
    sweep,
)
from bench.relay_bench import (
    CACHE_ONLY,
    RELAY_AWARE,
    VARIANTS,
    add_mesh_arguments,
    mesh_spec,
    workload,
)
from bench.report import (
    load_result,
    machine_info,
    max_compliant,
    reproduce_lines,
    run_stamp,
    write_section,
)
from bench.verdict import labelled, ranks_note
from relaygr.behaviours import RankInput
from relaygr.cli_help import HelpFormatter
from relaygr.config import add_config_arguments, load_config
from relaygr.cost import CostModel
from services.ranker.config import RankerConfig
from services.router.config import RouterConfig
from services.trigger.config import Mode, TriggerConfig
from tooling.local.drive import OK, Point, RequestRecord
from tooling.local.mesh import LocalMesh, MeshSpec
from tooling.sim.fleet import FleetSettings, run_visits
from tooling.sim.measured import mean_profile, read_profile
from tooling.sim.profile import DeviceProfile
from tooling.sim.workload import Visit, visits_of

NAME = "sim_validate"
CHECKED = (CACHE_ONLY, RELAY_AWARE)
LATENCY_TARGET = 0.15  # |simulated / real - 1| at most this, for P50 and P99
SHARE_TARGET = 0.03  # |simulated - real| at most this, for hit rate and relayed share
FIDELITY_QUANTILES = (50, 90, 99)
Config = TypeVar("Config")


# -- the two sides -------------------------------------------------------------------------------


def parsed(cls: type[Config], flags: Sequence[str]) -> Config:
    """A service's configuration from the flags its mesh process was given."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    return load_config(cls, parser.parse_args([*flags, "--plaintext"]))


def fleet_settings(spec: MeshSpec, mode: str, args: argparse.Namespace) -> FleetSettings:
    """The simulated fleet of `spec`'s mesh with its trigger in `mode`."""
    trigger = parsed(TriggerConfig, spec.trigger_args)
    return FleetSettings(
        rankers=spec.rankers,
        ranker=parsed(RankerConfig, spec.ranker_args),
        router=parsed(RouterConfig, spec.router_args),
        trigger=dataclasses.replace(trigger, mode=Mode(mode)),
        gap_s=args.gap_ms / 1e3,
        rank_timeout_s=args.timeout,
    )


def measured(mesh: LocalMesh, label: str) -> DeviceProfile:
    """The mean of the mesh's rankers' measured profiles, read now."""
    profiles = [read_profile(r.address, mesh.client_tls) for r in mesh.rankers]
    return mean_profile(profiles, f"measured: the {label} mesh's {len(profiles)} CPU rankers")


def outside_ms(records: Sequence[RequestRecord]) -> list[float]:
    """Each answered Rank's time outside the ranker: client latency minus its server_ms."""
    return [r.latency_s * 1e3 - r.server_ms for r in records if r.status == OK]


def replay(
    profile: DeviceProfile, settings: FleetSettings, ran: Sequence[Ran], seed: int
) -> list[list[RequestRecord]]:
    """A variant's points through one simulated fleet, each point's arrivals shifted by its
    real start after the first point's: each point's records, indexed and timed as its own."""
    visits: list[Visit] = []
    spans = []
    for point in ran:
        offset = point.began - ran[0].began
        own = visits_of(point.arrivals, point.follow)
        spans.append((len(visits), len(visits) + len(own), offset))
        visits += [dataclasses.replace(v, at=v.at + offset) for v in own]
    records, _ = run_visits(profile, settings, visits, seed)
    return [
        [dataclasses.replace(r, index=r.index - low, at=r.at - offset) for r in records[low:high]]
        for low, high, offset in spans
    ]


def percentiles(values: Sequence[float]) -> list[float]:
    """P50 and P99 (empty: none)."""
    return [float(np.percentile(values, q)) for q in (50, 99)] if values else []


def miss_slowdown(
    point: Ran, records: Sequence[RequestRecord], cost: CostModel, outside: float | None
) -> list[float]:
    """Over the point's counted Ranks served by full inference (miss or bypass): the median
    of their time in the ranker over their predicted compute (one full inference: the call
    the ranker serves a miss as), and how many there were. Time in the ranker: the real
    `server_ms` (`outside` None), or the simulated latency less the overhead `outside`."""

    def full_inference(request: RankInput) -> float:
        history = request.prefix.num_tokens + len(request.short_term)
        return cost.full_ms(history, len(request.candidates))

    return slowdown(point, records, ("miss", "bypass"), full_inference, outside)


def hit_slowdown(
    point: Ran, records: Sequence[RequestRecord], cost: CostModel, outside: float | None
) -> list[float]:
    """As `miss_slowdown`, over the Ranks served on a prefix held in the device tier
    (`hbm_hit`), against one Rank on the cached prefix (`CostModel.rank_ms`)."""

    def cached_rank(request: RankInput) -> float:
        short_term, candidates = len(request.short_term), len(request.candidates)
        return cost.rank_ms(request.prefix.num_tokens, short_term, candidates)

    return slowdown(point, records, ("hbm_hit",), cached_rank, outside)


def slowdown(
    point: Ran,
    records: Sequence[RequestRecord],
    outcomes: tuple[str, ...],
    predict: Callable[[RankInput], float],
    outside: float | None,
) -> list[float]:
    """Over the point's counted Ranks answered with one of `outcomes`: the median of their time
    in the ranker over `predict`ed compute, and how many there were."""
    ratios = []
    for r in records:
        arrival = point.arrivals[r.index]
        if arrival.at < point.warmup_s or r.status != OK or r.outcome not in outcomes:
            continue
        spent = r.server_ms if outside is None else r.latency_s * 1e3 - outside
        ratios.append(spent / predict(arrival.request))
    return [statistics.median(ratios), len(ratios)] if ratios else []


def compare_variant(
    label: str,
    ran: list[Ran],
    profile: DeviceProfile,
    after: DeviceProfile,
    spec: MeshSpec,
    seed: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One variant's real points, their simulated twins and what the simulator was given.

    Each point has two twins: `sim`, given the profile calibrated before any traffic, and
    `sim_served`, given the same profile with the cost model the rankers had refitted to the
    work they served by the sweep's end (`after`): compute as this host ran it under the
    mesh's load, which the calibration on an idle host does not see. The second changes
    nothing but the compute prices, so the two twins apart are what the calibration's error
    costs the simulator; the queueing and every decision are predicted alike."""
    overhead = statistics.median(outside_ms(ran[0].records) or [0.0])
    profile = dataclasses.replace(profile, request_overhead_ms=overhead)
    settings = fleet_settings(spec, VARIANTS[label][1], args)
    simulated = replay(profile, settings, ran, seed)
    served = replay(dataclasses.replace(profile, cost=after.cost), settings, ran, seed)
    points = []
    for point, records, served_records in zip(ran, simulated, served, strict=True):
        real = Point(**real_summary(point))
        twin = Point.of(point.label, point.rate, point.arrivals, records, point.warmup_s)
        served_twin = Point.of(
            point.label, point.rate, point.arrivals, served_records, point.warmup_s
        )
        counted = [r for r in point.records if point.arrivals[r.index].at >= point.warmup_s]
        server = [r.server_ms for r in counted if r.status == OK]
        points.append({
            "real": real.summary(),
            "sim": twin.summary(),
            "sim_served": served_twin.summary(),
            "real_outside_ms": percentiles(outside_ms(counted)),
            "real_server_ms": percentiles(server),
            "real_miss_slowdown": miss_slowdown(point, point.records, profile.cost, None),
            "sim_miss_slowdown": miss_slowdown(point, records, profile.cost, overhead),
            "real_hit_slowdown": hit_slowdown(point, point.records, profile.cost, None),
            "sim_hit_slowdown": hit_slowdown(point, records, profile.cost, overhead),
        })  # fmt: skip
        print(
            f"{label:>20} {point.rate:5g}/s  P50 {real.p50_ms:6.0f} / {twin.p50_ms:6.0f} / "
            f"{served_twin.p50_ms:6.0f}  P99 {real.p99_ms:6.0f} / {twin.p99_ms:6.0f} / "
            f"{served_twin.p99_ms:6.0f} ms  hit {real.hit_ratio:.0%} / {twin.hit_ratio:.0%}  "
            f"relayed {real.relayed_ratio:.0%} / {twin.relayed_ratio:.0%}"
            "  (real / simulated / simulated at the served cost)",
            flush=True,
        )
    return {
        "profile": dataclasses.asdict(profile),
        "cost_after": dataclasses.asdict(after.cost),
        "points": points,
    }


def real_sweep(
    seed: int, specs: dict[str, MeshSpec], args: argparse.Namespace
) -> tuple[list[Ran], dict[str, DeviceProfile], dict[str, DeviceProfile], int]:
    """One real sweep on fresh meshes of `specs` (per variant): its points, each variant's
    profile read before and after it, and the rankers' intra-op threads."""
    with ExitStack() as stack:
        meshes: dict[str, LocalMesh] = {}
        for label in CHECKED:
            print(f"seed {seed}: starting the {label} mesh (rankers calibrate)", flush=True)
            meshes[label] = stack.enter_context(LocalMesh(specs[label]))
        profiles = {label: measured(mesh, label) for label, mesh in meshes.items()}
        for label, p in profiles.items():
            print(f"{label}: {p.cost}", flush=True)
        variants = [Variant(label, meshes[label], VARIANTS[label][1]) for label in CHECKED]
        ran: list[Ran] = []
        sweep(variants, workload(args), args, seed, math.inf, ran)
        after = {label: measured(mesh, label) for label, mesh in meshes.items()}
        return ran, profiles, after, meshes[CHECKED[0]].ranker_threads


def run_seed(seed: int, model_path: Path, args: argparse.Namespace) -> tuple[dict, int]:
    """`args.mesh_runs` real sweeps, then the first one's points through the simulator; and the
    rankers' intra-op threads. The later sweeps are kept as each variant's `again`."""
    specs = {label: mesh_spec(VARIANTS[label][0], model_path, args) for label in CHECKED}
    sweeps = []
    for k in range(args.mesh_runs):
        print(f"seed {seed}: real sweep {k + 1} of {args.mesh_runs}", flush=True)
        sweeps.append(real_sweep(seed, specs, args))
    ran, profiles, after, threads = sweeps[0]
    print(f"seed {seed}: the same arrivals through the simulator", flush=True)
    variants_out = {}
    for label in CHECKED:
        out = compare_variant(
            label,
            [r for r in ran if r.label == label],
            profiles[label],
            after[label],
            specs[label],
            seed,
            args,
        )
        out["again"] = [
            [real_summary(r) for r in later if r.label == label] for later, *_ in sweeps[1:]
        ]
        variants_out[label] = out
    return variants_out, threads


def real_summary(point: Ran) -> dict[str, Any]:
    """The point's sums and latencies, as a result file keeps them."""
    real = Point.of(point.label, point.rate, point.arrivals, point.records, point.warmup_s)
    return real.summary()


def run(args: argparse.Namespace) -> dict:
    """Every seed; the result file is rewritten after each, so an interrupted run keeps the
    seeds it finished."""
    started = machine_info()  # the commit this run measures, stamped before it runs
    results: dict[str, Any] = {"seeds": {}, "ranker_threads": 0}
    saved: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = Path(tmp) / "model.json"
        model_path.write_text(json.dumps(BENCH_MODEL.to_dict()))
        for seed in seeds(args):
            results["seeds"][str(seed)], results["ranker_threads"] = run_seed(
                seed, model_path, args
            )
            saved = save_results(NAME, args, results, started, results["ranker_threads"])
    return saved


def seeds(args: argparse.Namespace) -> list[int]:
    return [args.seed + i for i in range(args.seeds)]


# -- the verdict (from saved results: --from-json re-renders without running) --------------------


def latency_cell(real: float, sim: float) -> tuple[str, bool]:
    """`sim / real` and whether it is within the latency target."""
    if not (math.isfinite(real) and math.isfinite(sim)) or real <= 0:
        return "-", False
    ratio = sim / real
    within = abs(ratio - 1) <= LATENCY_TARGET
    return f"{ratio:.2f} ({'yes' if within else 'no'})", within


def share_cell(real: float, sim: float) -> tuple[str, bool]:
    """Both shares and whether they are within the share target."""
    within = abs(sim - real) <= SHARE_TARGET + 1e-9
    return f"{real:.0%} / {sim:.0%} ({'yes' if within else 'no'})", within


def fidelity(runs: Sequence[float], sim: float) -> tuple[float, float, bool]:
    """One quantile of a point over its real runs and the simulator: the runs' spread (highest
    over lowest, less 1), the simulator's error against their mean (sim / mean - 1), and whether
    the simulator sits within the runs' range or within LATENCY_TARGET of their mean, whichever
    is wider."""
    finite = [v for v in runs if math.isfinite(v) and v > 0]
    if len(finite) < len(runs) or not runs or not math.isfinite(sim):
        return math.nan, math.nan, False
    low, high, mean = min(finite), max(finite), statistics.fmean(finite)
    error = sim / mean - 1
    return high / low - 1, error, low <= sim <= high or abs(error) <= LATENCY_TARGET + 1e-9


def quantile_ms(point: Point, q: float) -> float:
    return float(np.percentile(point.latencies_ms, q)) if point.latencies_ms else math.inf


def rerun_points(
    per_seed: dict[str, dict[str, Any]],
) -> Iterator[tuple[str, str, dict[str, Any], list[Point]]]:
    """Each point that has later real runs (--mesh-runs 2 or more): its seed, variant, saved
    record, and its real runs, the first sweep's first."""
    for seed, variants in per_seed.items():
        for label, out in variants.items():
            for i, raw in enumerate(out["points"]):
                later = [Point(**run[i]) for run in out.get("again", []) if i < len(run)]
                if later:
                    yield seed, label, raw, [Point(**raw["real"]), *later]


def fidelity_section(
    per_seed: dict[str, dict[str, Any]], twin: str = "sim", given: str = ""
) -> list[str]:
    """The fidelity verdict of the simulated twin `twin` (`sim`, or `sim_served`: see
    `compare_variant`) over every point that has later real runs (--mesh-runs 2 or more) and
    that twin; none: no lines. `given`: what that twin was given, for the heading."""
    rows: list[str] = []
    within = {q: 0 for q in FIDELITY_QUANTILES}
    spreads: dict[int, list[float]] = {q: [] for q in FIDELITY_QUANTILES}
    errors: dict[int, list[float]] = {q: [] for q in FIDELITY_QUANTILES}
    for seed, label, raw, real in rerun_points(per_seed):
        if twin not in raw:
            continue
        sim = Point(**raw[twin])
        cells = []
        for q in FIDELITY_QUANTILES:
            runs = [quantile_ms(r, q) for r in real]
            spread, error, ok = fidelity(runs, quantile_ms(sim, q))
            within[q] += ok
            spreads[q].append(spread)
            errors[q].append(abs(error))
            cells.append(
                f"{' / '.join(f'{v:.0f}' for v in runs)} | {quantile_ms(sim, q):.0f} "
                f"| {spread:.0%} | {error:+.0%} ({'yes' if ok else 'no'})"
            )
        ns = " / ".join(str(r.ok) for r in [*real, sim])
        rows.append(f"| {seed} | {label} | {real[0].rate:g} | {ns} | {' | '.join(cells)} |")
    if not rows:
        return []
    n = len(rows)
    summary = "; ".join(
        f"P{q} {within[q]} of {n} (median spread {statistics.median(spreads[q]):.0%}, median "
        f"error {statistics.median(errors[q]):.0%})"
        for q in FIDELITY_QUANTILES
    )
    head = " | ".join(
        f"P{q} real runs ms | P{q} sim ms | P{q} real spread | P{q} sim error (within)"
        for q in FIDELITY_QUANTILES
    )
    return [
        "**Fidelity: the same trace through the mesh twice and the simulator once"
        f"{given}.** Target: "
        "the simulator's P50, P90 and P99 within the range of the real runs, or within "
        f"{LATENCY_TARGET:.0%} of their mean, whichever is wider (`sim_validate.fidelity`). "
        "Spread: the real runs' highest over their lowest, less 1; error: simulated over the "
        "real runs' mean, less 1.",
        "",
        f"**Within: {summary}.**",
        "",
        f"| seed | variant | rate req/s | Ranks real runs / sim | {head} |",
        "|---:|---|---:|---|" + "---|---:|---:|---|" * len(FIDELITY_QUANTILES),
        *rows,
        "",
    ]


def paired(first: Point, second: Point) -> tuple[float, float] | None:
    """Two runs of one trace Rank by Rank: the median of `second`'s latency over `first`'s
    for each Rank, and the correlation of their latencies; None unless both answered every
    Rank they sent (only then is the i-th latency of each the same arrival's)."""
    a, b = first.latencies_ms, second.latencies_ms
    if not a or len(a) != len(b) or first.ok != first.sent or second.ok != second.sent:
        return None
    ratio = statistics.median(y / x for x, y in zip(a, b, strict=True) if x > 0)
    return ratio, float(np.corrcoef(a, b)[0, 1])


def paired_section(per_seed: dict[str, dict[str, Any]]) -> list[str]:
    """Each point with a second real run, Rank by Rank: how the second real run follows the
    first, and how each twin follows each real run; none: no lines."""
    rows: list[str] = []
    for seed, label, raw, (first, second, *_) in rerun_points(per_seed):
        twins = [Point(**raw[twin]) if twin in raw else None for twin in ("sim", "sim_served")]
        pairs = [(first, second)] + [(real, twin) for twin in twins for real in (first, second)]
        cells = []
        for a, b in pairs:
            got = None if b is None else paired(a, b)
            cells.append("-" if got is None else f"{got[0]:.2f}x, r {got[1]:.2f}")
        rows.append(f"| {seed} | {label} | {first.rate:g} | {' | '.join(cells)} |")
    if not rows:
        return []
    return [
        "**Rank by Rank** (each Rank's latency in one run over the same arrival's in another, "
        "median over the Ranks, and the correlation r of their latencies; `paired`): how "
        "closely the simulator follows each real run, beside how closely the real runs follow "
        "each other.",
        "",
        "| seed | variant | rate req/s | second real run / first | calibrated twin / first "
        "| calibrated twin / second | served twin / first | served twin / second |",
        "|---:|---|---:|---|---|---|---|---|",
        *rows,
        "",
    ]


def grid_steps(real: float, sim: float, rates: Sequence[float]) -> int:
    """How many steps of the rate grid (0, then the rates swept) lie between two figures."""
    grid = [0.0, *sorted(rates)]
    return abs(grid.index(real) - grid.index(sim))


def cost_text(cost: CostModel | dict[str, float]) -> str:
    c = cost if isinstance(cost, dict) else dataclasses.asdict(cost)
    text = (
        f"fixed {c['fixed_ms']:.2f} ms, per token {c['per_token_ms']:.4f} ms, per pair "
        f"{c['per_pair_ms']:.3g} ms, per candidate-key {c['per_candidate_key_ms']:.3g} ms"
    )
    if not CostModel(**c).prices_cached_ranks:  # a result saved before they existed
        return text
    return (
        f"{text}; cached rank: fixed {c['cached_fixed_ms']:.2f} ms, per row "
        f"{c['cached_per_row_ms']:.3g} ms, per key {c['cached_per_key_ms']:.3g} ms, per row-key "
        f"{c['cached_per_row_key_ms']:.3g} ms"
    )


def full_ms(cost: dict[str, Any], tokens: int, candidates: int) -> float:
    return CostModel(**cost).full_ms(tokens, candidates)


def render(saved: dict) -> str:
    args = argparse.Namespace(**saved["args"])
    info = saved["machine"]
    per_seed: dict[str, dict[str, Any]] = saved["seeds"]
    m = BENCH_MODEL
    counts = {"P50": [0, 0], "P99": [0, 0], "hit rate": [0, 0], "relayed share": [0, 0]}
    throughput_ok, throughput_n = 0, 0
    rows, detail, compliant, profiles = [], [], [], []
    for seed, variants in per_seed.items():
        for label, out in variants.items():
            pairs = [(Point(**p["real"]), Point(**p["sim"]), p) for p in out["points"]]
            for real, sim, raw in pairs:
                cells = {
                    "P50": latency_cell(real.p50_ms, sim.p50_ms),
                    "P99": latency_cell(real.p99_ms, sim.p99_ms),
                    "hit rate": share_cell(real.hit_ratio, sim.hit_ratio),
                    "relayed share": share_cell(real.relayed_ratio, sim.relayed_ratio),
                }
                for metric, (_, within) in cells.items():
                    counts[metric][0] += within
                    counts[metric][1] += 1
                rows.append(
                    f"| {seed} | {label} | {real.rate:g} | {real.ok} / {sim.ok} "
                    f"| {real.p50_ms:.0f} | {sim.p50_ms:.0f} | {cells['P50'][0]} "
                    f"| {real.p99_ms:.0f} | {sim.p99_ms:.0f} | {cells['P99'][0]} "
                    f"| {cells['hit rate'][0]} | {cells['relayed share'][0]} |"
                )
                outside, server = raw["real_outside_ms"], raw["real_server_ms"]
                detail.append(
                    f"| {seed} | {label} | {real.rate:g} "
                    f"| {' / '.join(f'{v:.0f}' for v in outside) or '-'} "
                    f"| {' / '.join(f'{v:.0f}' for v in server) or '-'} "
                    f"| {slowdown_text(raw['real_miss_slowdown'])} "
                    f"| {slowdown_text(raw['sim_miss_slowdown'])} "
                    f"| {slowdown_text(raw.get('real_hit_slowdown', []))} "
                    f"| {slowdown_text(raw.get('sim_hit_slowdown', []))} "
                    f"| {outcomes_text(real)} | {outcomes_text(sim)} "
                    f"| {reasons_text(real)} | {reasons_text(sim)} |"
                )
            real_best = max_compliant([r for r, _, _ in pairs], args.slo_ms)
            sim_best = max_compliant([s for _, s, _ in pairs], args.slo_ms)
            steps = grid_steps(real_best, sim_best, args.rates)
            throughput_ok += steps <= 1
            throughput_n += 1
            compliant.append(
                f"| {seed} | {label} | {real_best:g} | {sim_best:g} "
                f"| {steps} ({'yes' if steps <= 1 else 'no'}) |"
            )
            p = out["profile"]
            after = out["cost_after"]
            tokens = workload(args).median_long_term + workload(args).user_features
            candidates = workload(args).candidates
            profiles.append(
                f"| {seed} | {label} | {cost_text(p['cost'])} "
                f"| {p['cost']['median_abs_rel_error']:.1%} | {p['compute_noise']:.3f} "
                f"| {p['request_overhead_ms']:.1f} "
                f"| {full_ms(p['cost'], tokens, candidates):.0f} "
                f"| {full_ms(after, tokens, candidates):.0f} |"
            )
    summary = "; ".join(f"{metric} {ok} of {n}" for metric, (ok, n) in counts.items())
    real_ns = [p["real"]["ok"] for v in per_seed.values() for o in v.values() for p in o["points"]]
    few = labelled(ranks_note(real_ns))
    rates = ", ".join(f"{r:g}" for r in args.rates)
    return "\n".join([
        "## Simulator validation: the same trace through the real mesh and the simulator"
        + (f" ({args.tag})" if args.tag else ""),
        *reproduce_lines(saved),
        f"- {run_stamp(info)}; {len(per_seed)} seed(s) ({', '.join(per_seed)}). Real side: per "
        f"seed, fresh local meshes as `bench/relay_bench.py` starts them (etcd, two `relaygr "
        f"ranker` processes on CPU with {saved['ranker_threads']} intra-op thread(s) each, "
        f"router, trigger; model {m.num_layers} layers, d_model {m.d_model}; device tier "
        f"{args.hbm_mb} MiB per ranker, host tier {4 * args.hbm_mb} MiB), all on this "
        "machine's cores, driven open loop at rates "
        f"{rates} req/s, max({args.duration:g} s, {args.min_requests} requests) per point, "
        f"first {args.warmup:.0%} of each point excluded; retrieval-to-ranking gap "
        f"{args.gap_ms:.0f} ms; SLO {args.slo_ms:.0f} ms, at risk above "
        f"{args.slo_ms - args.margin_ms:.0f} ms of predicted full inference.",
        "- Simulated side: the same arrivals (`tooling.sim.workload.visits_of`), each point at "
        "its real start relative to the variant's first, through `tooling.sim.fleet` with the "
        "services' configurations parsed from the mesh's own flags and a measured profile: the "
        "mean of the mesh's two rankers' Describe (`tooling.sim.measured`), read after their "
        "start-up calibration and before any traffic; `compute_noise` from the fit's median "
        "error; `request_overhead_ms` the median, over the variant's first point's answered "
        "Ranks, of client latency minus the ranker's `server_ms`.",
        f"- Targets: P50 and P99 within {LATENCY_TARGET:.0%} of the real (simulated / real), "
        f"hit rate and relayed share of answered Ranks within {SHARE_TARGET * 100:.0f} points, "
        "SLO-compliant throughput (the highest rate below which every point met the SLO) within "
        "one step of the rate grid.",
        "",
        f"**Within target: {summary} points; compliant throughput {throughput_ok} of "
        f"{throughput_n} variant runs.**{few}",
        "",
        "| seed | variant | rate req/s | Ranks real / sim | P50 real ms | P50 sim ms "
        "| P50 sim/real | P99 real ms | P99 sim ms | P99 sim/real | hit rate real / sim "
        "| relayed real / sim |",
        "|---:|---|---:|---:|---:|---:|---|---:|---:|---|---|---|",
        *rows,
        "",
        *fidelity_section(per_seed, "sim", ", given the start-up calibration"),
        *fidelity_section(
            per_seed,
            "sim_served",
            ", given the cost the rankers learnt serving (the same profile, with the cost model "
            "they had refitted to their served work by the first real run's end; "
            "`compare_variant`)",
        ),
        *paired_section(per_seed),
        f"**SLO-compliant throughput at {args.slo_ms:.0f} ms, req/s:**",
        "",
        "| seed | variant | real | simulated | grid steps apart (within one) |",
        "|---:|---|---:|---:|---|",
        *compliant,
        "",
        "**Measured profiles** (mean of the two rankers; full inference predicted for the median "
        "history with its features and candidates, by the model read before the sweep and by "
        "the one the rankers had refitted to served work after it):",
        "",
        "| seed | variant | cost model | fit error | compute noise | request overhead ms "
        "| full inference ms, before | after the sweep |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
        *profiles,
        "",
        "<details><summary>Per point: where the real time went, cache outcomes and "
        "decisions</summary>",
        "",
        "Outside the ranker: client latency minus the ranker's `server_ms`. Full inference in "
        "the ranker: over the Ranks served by full inference, the median of their time in the "
        "ranker (real: `server_ms`; simulated: latency less the overhead) over the compute the "
        "profile predicts for them (one full inference; a result saved before the cached-rank "
        "terms existed priced a prefill, then a rank on it: one call's fixed cost more), and "
        "how many there were: "
        "above 1 is queueing, or compute slower than the cost model. Cached rank in the "
        "ranker: the same over the Ranks served on a prefix held in the device tier (`hbm_hit`), "
        "against one Rank on the cached prefix (the cached-rank terms; a result saved before "
        "this column: -).",
        "",
        "| seed | variant | rate | real outside the ranker P50 / P99 ms | real ranker server_ms "
        "P50 / P99 | full inference in the ranker / predicted, real | simulated "
        "| cached rank in the ranker / predicted, real | simulated | outcomes real "
        "| outcomes sim | decisions real | decisions sim |",
        "|---:|---|---:|---|---|---|---|---|---|---|---|---|---|",
        *detail,
        "",
        "</details>",
    ])  # fmt: skip


def slowdown_text(figure: list[float]) -> str:
    return f"{figure[0]:.2f}x ({figure[1]:.0f})" if figure else "-"


def outcomes_text(point: Point) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(point.outcomes.items())) or "-"


def reasons_text(point: Point) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(point.reasons.items())) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_sweep_arguments(parser, [0.25, 0.5, 0.75])
    add_mesh_arguments(parser)
    parser.set_defaults(duration=60.0, min_requests=30)
    parser.add_argument("--seeds", type=int, default=1, help="seeds: --seed, --seed + 1, ...")
    parser.add_argument(
        "--mesh-runs", type=int, default=1,
        help="real sweeps per seed, each on fresh meshes over the same trace (2: the fidelity"
        " verdict, the simulator beside the real runs' spread)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.from_json is not None:
        saved = load_result(args.from_json)
    else:
        if args.quick:
            args.rates, args.duration, args.min_requests, args.seeds = [0.5, 1.0], 10.0, 0, 1
        saved = run(args)
    saved_args = argparse.Namespace(**saved["args"])
    text = render(saved)
    print(text)
    if not args.no_docs and not saved_args.quick:
        write_section(ROOT / "docs" / "benchmarks.md", result_name(NAME, saved_args), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
