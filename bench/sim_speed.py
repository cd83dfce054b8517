"""How fast the simulator runs, and what memory a 10^8-user run takes.

Simulated requests per wall-clock second with 100 rankers (the H100 profile, 10^8 users) for
each variant, over repeats (median [range]; the machine is shared), and the process's peak
resident memory after them. Target: >= 10,000 simulated requests per second with 100 rankers;
memory bounded by the users who visit, not by the population.

    .venv/bin/python bench/sim_speed.py
"""

import argparse
import resource
import statistics
import time
from pathlib import Path

from bench.pipeline import ROOT, save_results
from bench.report import (
    add_run_arguments,
    machine_info,
    parse_run,
    publish,
    reproduce_lines,
    run_stamp,
)
from tooling.local.workload import WorkloadSpec
from tooling.sim.fleet import FleetSettings
from tooling.sim.profile import load_profile
from tooling.sim.sweep import VARIANTS, SweepSpec, run_point
from tooling.sim.workload import light_visits


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--profile", type=Path, default=ROOT / "profiles" / "nvidia-h100.toml")
    p.add_argument("--rankers", type=int, default=100)
    p.add_argument("--per-ranker", type=float, default=10.0, help="req/s per ranker")
    p.add_argument("--duration", type=float, default=20.0, help="simulated seconds")
    p.add_argument("--users", type=int, default=100_000_000)
    p.add_argument("--repeats", type=int, default=3)
    add_run_arguments(p)
    args = parse_run(p, argv)
    if args.quick:
        args.duration, args.repeats = 2.0, 1
    return args


def run(args: argparse.Namespace) -> dict:
    stamp = machine_info()  # the commit this run measures, stamped before it runs
    workload = WorkloadSpec(users=args.users, candidates=256, gap_s=0.1)
    fleet = FleetSettings.serving(args.rankers, 20.0, 10.0, 100.0, max(1, args.rankers // 10))
    spec = SweepSpec(load_profile(args.profile), fleet, workload, (), args.duration, (args.seed,))
    rate = args.per_ranker * args.rankers
    rows: list[dict] = []
    for repeat in range(args.repeats):
        started = time.perf_counter()
        visits = light_visits(workload, rate, args.duration, args.seed + repeat)
        drawn = time.perf_counter() - started
        for variant in VARIANTS:
            done = run_point(spec, variant, rate, args.seed + repeat, visits, args.duration)
            rows.append(
                {
                    "variant": variant,
                    "repeat": repeat,
                    "requests": len(visits),
                    "draw_s": drawn,
                    "sim_s": done.wall_s,
                    "per_s": len(visits) / done.wall_s,
                }
            )
            print(f"{variant:>22}: {len(visits) / done.wall_s:8,.0f} req/s", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return save_results("sim_speed", args, {"rows": rows, "max_rss_mib": rss}, stamp, threads=1)


def render(saved: dict) -> str:
    a = saved["args"]
    lines = [
        "## Simulator speed",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. {a['rankers']} simulated rankers at "
        f"{a['per_ranker']:g} req/s each ({a['per_ranker'] * a['rankers']:,.0f} req/s), "
        f"{a['users']:,} users, {a['duration']:g} simulated s per run, {a['repeats']} repeats; "
        f"peak resident memory of the whole run {saved['max_rss_mib']:,.0f} MiB.",
        "",
        "| variant | simulated requests per wall-clock s (median [range]) |",
        "|---|---:|",
    ]
    for variant in VARIANTS:
        speeds = [r["per_s"] for r in saved["rows"] if r["variant"] == variant]
        lo, mid, hi = min(speeds), statistics.median(speeds), max(speeds)
        lines.append(f"| {variant} | {mid:,.0f} [{lo:,.0f}-{hi:,.0f}] |")
    draws = [r["requests"] / r["draw_s"] for r in saved["rows"] if r["variant"] == "no cache"]
    lines += [
        "",
        f"Drawing the visits (burn-in included): {statistics.median(draws):,.0f} per s.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse()
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", "sim_speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
