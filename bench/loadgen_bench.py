"""MLPerf LoadGen's Server scenario on a local mesh: the highest valid QPS of each system.

Runs `relaygr loadgen` (tooling.local.loadgen; every option not listed here passes through to
it, see `relaygr loadgen --help`) with its result in bench/results/loadgen.json and LoadGen's
logs in a temporary folder unless `--out` is given (each test's LoadGen summary is kept in the
result), then renders the docs section.

    .venv/bin/python bench/loadgen_bench.py --modes "cache only" "relay sequence-aware"
    .venv/bin/python bench/loadgen_bench.py --from-json bench/results/loadgen.json --no-docs
"""

import argparse
import json
import sys
import tempfile
from typing import Any

from bench.pipeline import ROOT
from bench.report import (
    add_render_arguments,
    publish,
    reproduce_command,
    reproduce_lines,
    run_stamp,
)
from relaygr.cli_help import HelpFormatter
from tooling.local import loadgen
from tooling.local.drive import HIT_OUTCOMES
from tooling.local.modes import CACHE_ONLY, NO_CACHE, RELAY_ALL, RELAY_AWARE

NAME = "loadgen"


def run(args: argparse.Namespace) -> dict[str, Any]:
    options = list(args.loadgen_options)
    quick = "--smoke" in options
    result = ROOT / "bench" / "results" / f"{NAME}{'.quick' if quick else ''}.json"
    with tempfile.TemporaryDirectory(prefix="relaygr-loadgen-") as tmp:
        out = [] if "--out" in options else ["--out", tmp]
        loadgen.main([*options, *out, "--result", str(result)])
    saved: dict[str, Any] = json.loads(result.read_text())
    seed = saved["settings"]["seed"]
    saved["command"] = reproduce_command("loadgen_bench", seed)
    result.write_text(json.dumps(saved, indent=2) + "\n")
    return saved


def _cell(run: dict[str, Any]) -> str:
    """One test: QPS, LoadGen's verdict and latency at the target percentile."""
    verdict = run["loadgen"]
    unmet = [
        name
        for name, key in (
            ("latency", "perf_constraints_met"),
            ("early stopping", "early_stopping_met"),
            ("min duration", "min_duration_met"),
            ("min queries", "min_queries_met"),
        )
        if not verdict[key]
    ]
    failed = sum(run["pipeline"]["errors"].values())
    why = ", ".join([*unmet, *([f"{failed} failed Ranks"] if failed else [])])
    return (
        f"{run['qps']:g}: {verdict['validity']}{f' ({why})' if why else ''}, "
        f"{verdict['latency_ms']:.0f} ms"
    )


def render(saved: dict[str, Any]) -> str:
    s = saved["settings"]
    modes: dict[str, Any] = saved["modes"]
    pct = f"P{s['percentile'] * 100:g}"
    first = next(iter(modes.values()))["runs"]
    version = first[0]["loadgen"]["loadgen_version"] if first else "?"
    rows = [
        f"| system | highest valid QPS | tests in search order (QPS: LoadGen verdict, {pct} "
        "latency) |",
        "|---|---:|---|",
    ]
    for label, found in modes.items():
        bound = any(r["qps"] >= s["qps_max"] and r["valid"] for r in found["runs"])
        highest = f"{found['highest_valid_qps']:g}" + (" (the bound: at least)" if bound else "")
        rows.append(f"| {label} | {highest} | {'; '.join(_cell(r) for r in found['runs'])} |")
    best = {label: found["highest_valid_qps"] for label, found in modes.items()}
    relay = max((best[m.label] for m in (RELAY_ALL, RELAY_AWARE) if m.label in best), default=None)
    base = max((best[m.label] for m in (NO_CACHE, CACHE_ONLY) if m.label in best), default=None)
    headline = []
    if relay is not None and base is not None:
        ratio = f"{relay / base:.1f}x" if base else "baseline never valid"
        headline = [
            f"- **Highest valid QPS, best relay system vs best system without it: {relay:g} vs "
            f"{base:g} ({ratio})**, one seed, single runs: indicative only.",
            "",
        ]
    p99 = pct != "P99"  # a second latency column when the target's percentile is another
    detail = [
        f"| system | target QPS | LoadGen | scheduled/s | completed/s | {pct} ms "
        + ("| P99 ms " if p99 else "")
        + "| over target | relayed | cross-visit | failed Ranks |",
        "|---|---:|---|---:|---:|---:|" + ("---:|" if p99 else "") + "---:|---:|---:|---:|",
    ]
    for label, found in modes.items():
        for r in found["runs"]:
            v, p = r["loadgen"], r["pipeline"]
            ok = max(1, p["ok"])
            hits = sum(n for k, n in p["outcomes"].items() if k in HIT_OUTCOMES)
            detail.append(
                f"| {label} | {r['qps']:g} | {v['validity']} | {v['scheduled_qps']:.2f} "
                f"| {v['completed_qps']:.2f} | {v['latency_ms']:.0f} "
                + (f"| {v['p99_ms']:.0f} " if p99 else "")
                + f"| {v['overlatency']}/{v['queries']} | {p['relayed'] / ok:.0%} "
                f"| {(hits - p['relayed']) / ok:.0%} | {sum(p['errors'].values())} |"
            )
    threads = saved.get("ranker_threads", saved["machine"]["threads"])
    return "\n".join([
        "## MLPerf LoadGen: the highest valid QPS of each system (Server scenario)",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. Target: {saved['target']} ({s['rankers']} "
        f"`relaygr ranker` processes, model `{s['model']}` on CPU, {threads} intra-op "
        "thread(s) each; router; trigger; etcd), one mesh for the caching systems and one "
        "whose rankers bypass every cache.",
        f"- MLPerf LoadGen {version}, Server scenario, PerformanceOnly: LoadGen's Poisson "
        "schedule at the target QPS; a query is a visit of the seeded population (its "
        "retrieval event to the trigger, its Rank to the router one gap later) and completes "
        f"when the Rank answers. Target latency: gap {s['gap_ms']:g} + SLO {s['slo_ms']:g} = "
        f"{s['target_latency_ms']:g} ms at {pct}; at least {s['min_duration_s']:g} s and "
        f"{s['min_queries']} queries a test.",
        "- Valid: LoadGen's verdict VALID (latency at the percentile, minimum duration and "
        "queries, its early stopping) and no failed Rank. Search: target QPS on a grid of "
        f"{s['qps_step']:g}, doubling from {s['qps_from']:g} until a test is not valid "
        f"(halving down to {s.get('qps_min', s['qps_from']):g} when the first is not), then "
        f"bisecting, at most {s['qps_max']:g}.",
        f"- Population: {s['users']:,} users, long-term histories log-normal (median "
        f"{s['median_long_term']}, at most {s['max_long_term']}); seed {s['seed']}; each test "
        "with users of its own (no test warms another's cache).",
        "",
        *headline,
        *rows,
        "",
        "<details><summary>Every test</summary>",
        "",
        *detail,
        "",
        "</details>",
    ])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_render_arguments(parser)
    args, rest = parser.parse_known_args()
    args.loadgen_options = rest
    args.no_docs = args.no_docs or "--smoke" in rest  # a smoke run is not a result
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
