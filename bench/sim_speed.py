"""How fast the simulator runs, and what memory a 10^8-user run takes.

Simulated requests per wall-clock second with 100 rankers (the H100 profile, 10^8 users) for
each variant, over repeats (median [range]; the machine is shared), and the process's peak
resident memory after them. Target: >= 10,000 simulated requests per second with 100 rankers;
memory bounded by the users who visit, not by the population.

Then each variant once more, over `--split-duration` simulated seconds under cProfile: the share
of its time in the services' own code (the ranker core, the router's forwarder, the trigger's
policy and what they share, which the simulator runs as they are) against the simulator's
drivers (`bench.time_split`). The services' share of a request's unprofiled time bounds how fast
any driver can run it.

    .venv/bin/python bench/sim_speed.py
"""

import argparse
import resource
import statistics
import time
from functools import partial
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
from bench.time_split import DRIVER, LIBRARY, SERVICES, profiled
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
    p.add_argument(
        "--split-duration", type=float, default=5.0, help="simulated s of each profiled run"
    )
    add_run_arguments(p)
    args = parse_run(p, argv)
    if args.quick:
        args.duration, args.repeats, args.split_duration = 2.0, 1, 1.0
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
    visits = light_visits(workload, rate, args.split_duration, args.seed)
    splits: list[dict] = []
    for variant in VARIANTS:
        run = partial(run_point, spec, variant, rate, args.seed, visits, args.split_duration)
        _, seconds, calls = profiled(run)
        splits.append({"variant": variant, "requests": len(visits), "calls": calls, **seconds})
    results = {"rows": rows, "max_rss_mib": rss, "splits": splits}
    return save_results("sim_speed", args, results, stamp, threads=1)


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
        *render_splits(saved),
    ]
    return "\n".join(lines) + "\n"


def render_splits(saved: dict) -> list[str]:
    """Where each variant's time goes, and the fastest any driver could run it: a request's
    median unprofiled time, of which the services' own code takes its profiled share."""
    lines = [
        "",
        f"Where the time goes: each variant once more, {saved['args']['split_duration']:g} "
        "simulated s under cProfile (`bench.time_split`; a library function's time counted "
        "for its caller). The services' own code is what the simulator must run as it is: "
        "without any driver cost, a request still takes that.",
        "",
        "| variant | us a request (timed runs' median) | calls a request | services' own "
        "code | drivers | libraries | services' code: us a request | fastest, with drivers "
        "that cost nothing: req/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for split in saved["splits"]:
        variant = split["variant"]
        speed = statistics.median(r["per_s"] for r in saved["rows"] if r["variant"] == variant)
        total = split[SERVICES] + split[DRIVER] + split[LIBRARY]
        share = {floor: split[floor] / total for floor in (SERVICES, DRIVER, LIBRARY)}
        us = 1e6 / speed
        lines.append(
            f"| {variant} | {us:,.0f} | {split['calls'] / split['requests']:,.0f} | "
            f"{share[SERVICES]:.0%} | {share[DRIVER]:.0%} | {share[LIBRARY]:.0%} | "
            f"{us * share[SERVICES]:,.0f} | {speed / share[SERVICES]:,.0f} |"
        )
    return lines


def main() -> int:
    args = parse()
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", "sim_speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
