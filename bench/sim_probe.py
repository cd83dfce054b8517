"""Each variant's P99 at every rate asked for, at one of the map's points (issue 26).

`bench/sim_map.py` finds a variant's compliant throughput by doubling the rate and then
bisecting it, which assumes that passing is monotone in the rate. Near the SLO a point's P99
rests on a few hundred Ranks and need not be: a variant can fail at one rate and pass at a
higher one, and the bisection stops at whichever it meets. A map row where two variants differ
by a grid step or two may be that, not a difference between them. This runs every rate asked
for, on the map's own points, visits and options, and shows each P99 with its bootstrap 95%
interval and the Ranks it counts, the variants side by side on the same visits.

    .venv/bin/python bench/sim_probe.py --seed 20261205 --seeds 3 \\
        --probe nvidia-h100 gap_ms=50 60 62.5 65 67.5 70
"""

import argparse
from typing import Any

from bench.pipeline import ROOT, result_name, save_results
from bench.report import machine_info, publish, reproduce_lines, run_stamp
from bench.sim_map import AXES, CORNERS, map_points, parse, point_span, point_spec
from bench.verdict import p99_interval
from tooling.sim.profile import load_profile
from tooling.sim.sweep import VARIANTS, run_point
from tooling.sim.workload import light_visits

NAME = "sim_probe"


def probe_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--probe", nargs="+", action="append", default=[],
        metavar="PROFILE POINT RATE",
        help="a profile (under profiles/), a map point's label and the req/s per ranker to run "
        "it at; repeat for more points",
    )  # fmt: skip


def probes(args: argparse.Namespace) -> list[tuple[str, str, list[float]]]:
    """(profile, point label, rates) of each --probe; a point the map lacks is refused."""
    if not args.probe:
        raise SystemExit("--probe PROFILE POINT RATE...: at least one point to run")
    labels = {p.label for p in map_points(AXES, CORNERS)}
    out = []
    for spec in args.probe:
        if len(spec) < 3:
            raise SystemExit(f"--probe {' '.join(spec)}: a profile, a point and rates")
        profile, label, *rates = spec
        if label not in labels:
            raise SystemExit(f"--probe: no such point: {label}")
        out.append((profile, label, sorted({float(rate) for rate in rates})))
    return out


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    points = {p.label: p for p in map_points(AXES, CORNERS)}
    seeds = [args.seed + i for i in range(args.seeds)]
    rows = []
    for profile, label, rates in probes(args):
        base = load_profile(ROOT / "profiles" / f"{profile}.toml")
        for seed in seeds:
            spec = point_spec(args, base, points[label].values, seed)
            for per_ranker in rates:
                rate = per_ranker * args.rankers
                span = point_span(args, spec, rate)
                visits = light_visits(spec.workload, rate, span, seed)
                for variant in VARIANTS:
                    done = run_point(spec, variant, rate, seed, visits, span).point
                    tail = p99_interval(done.latencies_ms)
                    rows.append({
                        "profile": profile, "point": label, "seed": seed, "variant": variant,
                        "per_ranker": per_ranker, "p99_ms": done.p99_ms, "low_ms": tail.low,
                        "high_ms": tail.high, "ranks": tail.n,
                        "compliant": done.compliant(spec.slo_ms), "slo_ms": spec.slo_ms,
                    })  # fmt: skip
                    print(f"{profile} {label} seed {seed} {variant:>22} {per_ranker:g}/s/ranker "
                          f"p99 {done.p99_ms:.1f} ms", flush=True)  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> dict:
    stamp = machine_info()  # the commit this run measures, stamped before it runs
    rows = measure(args)
    return save_results(NAME, args, {"rows": rows}, stamp, threads=1)


def first_failure(rows: list[dict[str, Any]]) -> float | None:
    """The lowest rate at which a variant's rows fail; None if none does."""
    return min((r["per_ranker"] for r in rows if not r["compliant"]), default=None)


def render(saved: dict) -> str:
    rows = saved["rows"]
    lines = [
        "## P99 at every rate near a map row's edge (simulated)",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. The map's points (`bench/sim_map.py`, its options "
        "and visits), every rate listed run, each variant on the same visits. A cell: P99 ms "
        "[bootstrap 95% interval], ok or -- against the SLO (and no failure), Ranks counted.",
    ]
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["profile"], row["point"], row["seed"]), []).append(row)
    for (profile, point, seed), group in groups.items():
        variants = [v for v in VARIANTS if any(r["variant"] == v for r in group)]
        lines += [
            "",
            f"**{profile}, {point}, seed {seed}** (SLO {group[0]['slo_ms']:g} ms):",
            "",
            "| req/s per ranker | " + " | ".join(variants) + " |",
            "|---:|" + "---|" * len(variants),
        ]
        for rate in sorted({r["per_ranker"] for r in group}):
            cells = []
            for variant in variants:
                r = next(x for x in group if x["variant"] == variant and x["per_ranker"] == rate)
                verdict = "ok" if r["compliant"] else "--"
                cells.append(
                    f"{r['p99_ms']:.1f} [{r['low_ms']:.1f}-{r['high_ms']:.1f}] {verdict}, "
                    f"n={r['ranks']}"
                )
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
        fails = []
        for variant in variants:
            first = first_failure([r for r in group if r["variant"] == variant])
            fails.append(f"{variant} {'none' if first is None else f'{first:g}'}")
        lines += ["", "First failure from below: " + "; ".join(fails) + "."]
    return "\n".join(lines)


def main() -> int:
    args = parse(description=__doc__, options=probe_option)
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", result_name(NAME, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
