"""The relay at the paper's scale, simulated: accelerator rankers, hundreds of requests per second.

The measurement benchmark's four variants (no cache, cache only, relay all, relay
sequence-aware) on a fleet of simulated rankers with an accelerator profile (default
profiles/nvidia-h100.toml: figures cited, derivations labelled as assumptions), a population of
10^8 users with the Yambda-matched history lengths, over seeds:

1. SLO-compliant throughput: an open-loop rate sweep per variant; the relay against the best
   non-relay variant, and the trigger's ablation (relay all vs sequence-aware) with hit rates and
   refusals;
2. the longest sequence within the SLO at a fixed rate: every user's history of one length,
   searched on a 1,024-token grid.

    .venv/bin/python bench/sim_paper.py            # the full run (docs/benchmarks.md)
    .venv/bin/python bench/sim_paper.py --quick    # smoke run, not recorded in docs
"""

import argparse
import random
import statistics
from dataclasses import replace
from pathlib import Path

from bench.pipeline import ROOT, result_name, save_results
from bench.report import add_render_arguments, machine_info, publish, reproduce_lines, run_stamp
from bench.verdict import (
    MIN_SIM_SEEDS,
    add_seeds_rule,
    check_seeds,
    grid_search,
    labelled,
    seeds_note,
)
from services.trigger.policy import relays_admitted
from tooling.local.compliance import max_compliant
from tooling.local.workload import WorkloadSpec
from tooling.sim.fleet import FleetSettings
from tooling.sim.profile import load_profile
from tooling.sim.sweep import BASELINES, RELAYS, VARIANTS, SweepSpec, run_point
from tooling.sim.workload import light_visits

LENGTH_STEP = 1024


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--profile", type=Path, default=ROOT / "profiles" / "nvidia-h100.toml")
    p.add_argument(
        "--device-tier-mib",
        type=float,
        default=None,
        help="override the profile's device tier per ranker (default: the profile's)",
    )
    p.add_argument("--rankers", type=int, default=8)
    p.add_argument(
        "--per-ranker",
        type=float,
        nargs="+",
        default=[25, 50, 100, 200, 400],
        help="offered req/s per ranker (the sweep's rates are these x rankers)",
    )
    p.add_argument("--duration", type=float, default=20.0, help="simulated seconds per point")
    p.add_argument("--users", type=int, default=100_000_000)
    p.add_argument("--slo-ms", type=float, default=50.0)
    p.add_argument("--margin-ms", type=float, default=5.0)
    p.add_argument("--gap-ms", type=float, default=100.0, help="retrieval to ranking")
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--max-long-term", type=int, default=8192)
    p.add_argument(
        "--length-rate", type=float, default=50.0, help="req/s per ranker of the length search"
    )
    p.add_argument("--length-max", type=int, default=32768)
    p.add_argument(
        "--seeds", type=int, default=MIN_SIM_SEEDS, help="seeds from --seed on (at least 5)"
    )
    p.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    p.add_argument("--quick", action="store_true", help="smoke run: one seed, short points")
    p.add_argument("--tag", default="", help="suffix of the result file and docs section")
    add_seeds_rule(p)
    add_render_arguments(p)
    args = p.parse_args(argv)
    check_seeds(p, args, args.seeds)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**32)
    if args.quick:
        args.seeds, args.duration, args.per_ranker = 1, 5.0, [50, 200]
    return args


def base_spec(args: argparse.Namespace, seed: int) -> SweepSpec:
    profile = load_profile(args.profile)
    if args.device_tier_mib is not None:
        profile = profile.with_memory(int(args.device_tier_mib * 2**20))
    workload = WorkloadSpec(
        users=args.users,
        max_long_term=args.max_long_term,
        candidates=args.candidates,
        gap_s=args.gap_ms / 1e3,
    )
    fleet = FleetSettings.serving(args.rankers, args.slo_ms, args.margin_ms, args.gap_ms)
    return SweepSpec(profile, fleet, workload, (), args.duration, (seed,))


def run(args: argparse.Namespace) -> dict:
    started = machine_info()  # the commit this run measures, stamped before it runs
    seeds = [args.seed + i for i in range(args.seeds)]
    rates = [r * args.rankers for r in args.per_ranker]
    sweep: list[dict] = []
    lengths: list[dict] = []
    for seed in seeds:
        spec = base_spec(args, seed)
        for rate in rates:
            visits = light_visits(spec.workload, rate, spec.duration_s, seed)
            for variant in VARIANTS:
                done = run_point(spec, variant, rate, seed, visits, spec.duration_s)
                sweep.append(done.summary(spec.slo_ms))
                p = done.point
                print(
                    f"seed {seed} {variant:>22} {rate:7g}/s p50 {p.p50_ms:7.1f} p99 "
                    f"{p.p99_ms:8.1f} ms hits {p.hit_ratio:.0%} relayed {p.relayed_ratio:.0%} "
                    f"failed {p.sent - p.ok} ({done.wall_s:.1f} s)",
                    flush=True,
                )
        rate = args.length_rate * args.rankers
        for variant in VARIANTS:
            lengths += length_search(spec, variant, rate, seed, args.length_max)
    profile = load_profile(args.profile)
    results = {
        "seeds": seeds,
        "rates": rates,
        "profile": {
            "name": profile.name,
            "kind": profile.kind,
            "device_tier_mib": (args.device_tier_mib or profile.device_tier_bytes / 2**20),
            "kv_bytes_per_token": profile.kv_bytes_per_token,
        },
        "sweep": sweep,
        "lengths": lengths,
    }
    return save_results("sim_paper", args, results, started, threads=1)


def length_search(
    spec: SweepSpec, variant: str, rate: float, seed: int, length_max: int
) -> list[dict]:
    """The points of `variant`'s search for its longest history within the SLO at `rate`."""
    rows: list[dict] = []

    def passes(length: int) -> bool:
        fixed = replace(
            spec.workload,
            median_long_term=length,
            long_term_sigma=0.0,
            min_long_term=length,
            max_long_term=length,
            user_prefix=f"L{length}",
        )
        visits = light_visits(fixed, rate, spec.duration_s, seed)
        point_spec = replace(spec, workload=fixed)
        done = run_point(point_spec, variant, rate, seed, visits, spec.duration_s)
        rows.append({**done.summary(spec.slo_ms), "length": length})
        ok = done.point.compliant(spec.slo_ms)
        p99 = done.point.p99_ms
        print(f"seed {seed} {variant:>22} length {length:6d}: p99 {p99:8.1f} ms", flush=True)
        return ok

    grid_search(LENGTH_STEP, length_max, LENGTH_STEP, passes)
    return rows


def spread(values: list[float]) -> str:
    mid = statistics.median(values)
    lo, hi = min(values), max(values)
    return f"{mid:g}" if lo == hi else f"{mid:g} [{lo:g}-{hi:g}]"


def ratio(a: float, b: float) -> str:
    return "baseline never compliant" if b == 0 else f"{a / b:.2f}x"


def render(saved: dict) -> str:
    a = saved["args"]
    seeds, slo = saved["seeds"], a["slo_ms"]
    per_seed: dict[str, dict[int, float]] = {v: {} for v in VARIANTS}
    longest: dict[str, dict[int, int]] = {v: {} for v in VARIANTS}
    for v in VARIANTS:
        for s in seeds:
            mine = [_P(p) for p in saved["sweep"] if p["variant"] == v and p["seed"] == s]
            per_seed[v][s] = max_compliant(mine, slo)
            ok = [
                p["length"]
                for p in saved["lengths"]
                if p["variant"] == v and p["seed"] == s and not p["errors"] and p["p99_ms"] <= slo
            ]
            longest[v][s] = max(ok, default=0)
    profile = saved["profile"]
    lines = [
        "## Simulated at the paper's scale: accelerator rankers",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. Simulated (`tooling.sim`), not measured: profile "
        f"`{profile['name']}` ({profile['kind']}: cited figures and labelled assumptions, "
        f"profiles/README.md), device tier {profile['device_tier_mib']:,.0f} MiB per ranker, "
        f"{profile['kv_bytes_per_token']:,} bytes per cached token.",
        f"- Fleet: {a['rankers']} rankers; SLO {slo:g} ms P99 (margin {a['margin_ms']:g} ms); "
        f"retrieval-to-ranking gap {a['gap_ms']:g} ms; {a['candidates']} candidates; "
        f"{a['users']:,} users, Yambda-matched lengths capped at {a['max_long_term']:,}; "
        f"{a['duration']:g} s per point (first 20% not counted); "
        f"seeds {', '.join(map(str, seeds))}.",
        "",
        f"**SLO-compliant throughput** at {slo:g} ms, req/s over the fleet "
        "(median [range] over seeds):",
        "",
        "| variant | req/s | per ranker |",
        "|---|---:|---:|",
    ]
    for v in VARIANTS:
        values = list(per_seed[v].values())
        lines.append(f"| {v} | {spread(values)} | {statistics.median(values) / a['rankers']:g} |")
    best_relay = {s: max(per_seed[v][s] for v in RELAYS) for s in seeds}
    best_base = {s: max(per_seed[v][s] for v in BASELINES) for s in seeds}
    ratios = [ratio(best_relay[s], best_base[s]) for s in seeds]
    aware_vs_all = [
        ratio(per_seed["relay sequence-aware"][s], per_seed["relay all"][s]) for s in seeds
    ]
    few = seeds_note(len(seeds))
    few = labelled(few)
    lines += [
        "",
        f"- Best relay vs best non-relay, per seed: {', '.join(ratios)} (paper: 3.6x).{few}",
        f"- Trigger ablation, sequence-aware vs relay all, per seed: {', '.join(aware_vs_all)}.",
        "",
        "**Longest sequence within the SLO** at "
        f"{a['length_rate'] * a['rankers']:g} req/s (every user's history of one length, "
        f"{LENGTH_STEP:,}-token grid):",
        "",
        "| variant | tokens (median [range]) |",
        "|---|---:|",
    ]
    for v in VARIANTS:
        lines.append(f"| {v} | {spread([float(x) for x in longest[v].values()])} |")
    lr = [
        ratio(max(longest[v][s] for v in RELAYS), max(longest[v][s] for v in BASELINES))
        for s in seeds
    ]
    lines += [
        "",
        f"- Best relay vs best non-relay, per seed: {', '.join(lr)} (paper: 1.5x).{few}",
        "",
        "**Every point of the sweep** (all seeds):",
        "",
        "| variant | seed | req/s | P50 ms | P99 ms | hits | relayed | cross-visit | admitted | "
        "not at risk | no room / footprint / load | relays refused | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for p in saved["sweep"]:
        r = p["reasons"]
        refusals = "/".join(str(r.get(k, 0)) for k in ("no_room", "footprint_limit", "load_limit"))
        lines.append(
            f"| {p['variant']} | {p['seed']} | {p['rate']:g} | {p['p50_ms']:.1f} "
            f"| {p['p99_ms']:.1f} "
            f"| {p['hit_ratio']:.0%} | {p['relayed_ratio']:.0%} | {p['cached_ratio']:.0%} "
            f"| {relays_admitted(r):,} | {r.get('not_at_risk', 0):,} | {refusals} "
            f"| {p['fleet']['relays_refused']:,} | {p['sent'] - p['ok']:,} |"
        )
    return "\n".join(lines) + "\n"


class _P:
    """A saved point as `max_compliant` reads it."""

    def __init__(self, raw: dict) -> None:
        self.rate, self.p99_ms, self.errors = raw["rate"], raw["p99_ms"], raw["errors"]


def main() -> int:
    args = parse()
    name = result_name("sim_paper", args)
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
