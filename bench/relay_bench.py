"""What the relay adds: the relay against the best system without it, on one trace, over seeds.

Variants, each on its own local mesh (etcd, two rankers, router, trigger; every ranker with its
share of the cores), each driven through the full pipeline with its own copy of the same seeded
trace (same users, visits and requests; own user ids, so no variant warms another's cache):
- no cache: rankers in bypass (every Rank a full inference);
- cache only: nothing pre-inferred; rankers keep the prefixes their Ranks computed, so a return
  visit can hit (HBM or DRAM): the strongest system without the relay;
- relay all: the trigger relays every retrieval event;
- relay sequence-aware: the trigger relays the at-risk events within its footprint and load
  budgets;
- (optional) no DRAM tier, random placement: ablations of the relay.

Per seed: (1) an open-loop rate sweep, variants in rotating order at each rate; (2) the longest
long-term length whose P99 meets the SLO at a fixed rate, searched on a 512-token grid. Verdicts
are medians over seeds with their range: SLO-compliant throughput at every SLO of a curve, and
the relay (the better relay variant) against the better non-relay variant.

    .venv/bin/python bench/relay_bench.py            # the full run (see docs/benchmarks.md)
    .venv/bin/python bench/relay_bench.py --quick    # smoke run, results not recorded in docs
"""

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from bench.pipeline import (
    BENCH_MODEL,
    ROOT,
    Variant,
    add_sweep_arguments,
    population,
    ranker_args,
    result_name,
    run_point,
    save_results,
    sweep,
)
from bench.report import load_result, machine_info, max_compliant, run_stamp, write_section
from bench.verdict import (
    PairedRatios,
    Spread,
    compliant_throughput,
    grid_search,
    labelled,
    p99_ci,
    ranks_note,
)
from relaygr.cli_help import HelpFormatter
from services.trigger.policy import relays_admitted
from tooling.local.drive import Point
from tooling.local.mesh import LocalMesh, MeshSpec
from tooling.local.modes import NO_CACHE as NO_CACHE_SYSTEM
from tooling.local.modes import SYSTEMS
from tooling.local.workload import WorkloadSpec, distinct_users, poisson_arrivals

NO_CACHE, CACHE_ONLY, RELAY_ALL, RELAY_AWARE = (system.label for system in SYSTEMS)
BASELINES = (NO_CACHE, CACHE_ONLY)
RELAYS = (RELAY_ALL, RELAY_AWARE)

# label -> (mesh kind, trigger mode): the four systems (tooling.local.modes), then ablations.
VARIANTS: dict[str, tuple[str, str]] = {
    **{s.label: ("bypass" if s.bypass else "system", s.trigger_mode) for s in SYSTEMS},
    "no DRAM tier": ("no-dram", "sequence-aware"),
    "random placement": ("random", "sequence-aware"),
}
LENGTH_STEP = 512


def mesh_spec(kind: str, model_path: Path, args: argparse.Namespace) -> MeshSpec:
    ranker = ranker_args(model_path, args.hbm_mb)
    trigger = (
        "--slo-ms", str(args.slo_ms), "--margin-ms", str(args.margin_ms),
        "--expected-gap-ms", str(args.gap_ms),
    )  # fmt: skip
    base = MeshSpec(rankers=2, ranker_args=ranker, trigger_args=trigger)
    return {
        "system": base,
        "bypass": replace(base, ranker_args=(*ranker, *NO_CACHE_SYSTEM.ranker_flags())),
        "no-dram": replace(base, ranker_args=(*ranker, "--dram-budget-mb", "0")),
        "random": replace(base, router_args=("--placement", "random")),
    }[kind]


def workload(args: argparse.Namespace) -> WorkloadSpec:
    # Results saved before --no-show existed re-render without it: no no-shows then.
    no_show = getattr(args, "no_show", 0.0)
    return WorkloadSpec(users=args.users, gap_s=args.gap_ms / 1e3, no_show_p=no_show)


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `mesh_spec` and `workload` read, with this benchmark's defaults (after
    `add_sweep_arguments`; the simulator's check, bench/sim_validate.py, shares them)."""
    parser.set_defaults(slo_ms=1500.0, margin_ms=1250.0, gap_ms=1500.0)
    parser.add_argument("--users", type=int, default=WorkloadSpec().users, help="population")
    parser.add_argument("--hbm-mb", type=int, default=128, help="device tier per ranker")
    parser.add_argument(
        "--no-show", type=float, default=0.0,
        help="share of retrievals never followed by a Rank (filtered, abandoned): the trigger"
        " still sees their events",
    )  # fmt: skip


def length_search(variant: Variant, seed: int, args: argparse.Namespace) -> list[Point]:
    """The length points tried for `variant` (rate column holds the length), searched upwards
    on the 512-token grid at `args.length_rate`; fresh users for each length."""
    spec = workload(args)
    points: list[Point] = []

    def passes(length: int) -> bool:
        fixed = replace(
            spec, median_long_term=length, long_term_sigma=0.0, min_long_term=length,
            max_long_term=length,
        )  # fmt: skip
        pop = population(variant.label, fixed, seed, f"-L{length}")
        short = argparse.Namespace(**{**vars(args), "min_requests": args.length_requests})
        point = run_point(variant, pop, args.length_rate, short)
        point.rate = float(length)
        points.append(point)
        return point.compliant(args.slo_ms)

    grid_search(args.length_from, args.length_max, LENGTH_STEP, passes)
    return points


def slo_curve(args: argparse.Namespace) -> list[float]:
    return sorted({*args.slos, args.slo_ms})


def population_info(args: argparse.Namespace) -> dict[str, object]:
    """The population's parameters and, over ten minutes of its traffic at 1 req/s, how many
    distinct users a ranker fleet meets (what the tiers would have to hold)."""
    spec = workload(args)
    sample = poisson_arrivals(population("probe", spec, args.seed), 1.0, 600.0)
    return {
        "users": spec.users,
        "median_long_term": spec.median_long_term,
        "long_term_sigma": spec.long_term_sigma,
        "max_long_term": spec.max_long_term,
        "zipf_s": spec.zipf_s,
        "revisit_p": spec.revisit_p,
        "revisit_gap_s": spec.revisit_gap_s,
        "no_show_p": spec.no_show_p,
        "sample_visits": len(sample),
        "sample_distinct_users": distinct_users(sample),
    }


def run(args: argparse.Namespace) -> dict:
    """Every seed's sweeps; the result file is rewritten after each seed, so an interrupted run
    keeps the seeds it finished."""
    started = machine_info()  # the commit this run measures, stamped before it runs
    print(f"seed {args.seed}, seeds {seeds(args)}", flush=True)
    results: dict = {"seeds": {}, "ranker_threads": 0, "population": population_info(args)}
    saved: dict = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        model_path = Path(tmp) / "model.json"
        model_path.write_text(json.dumps(BENCH_MODEL.to_dict()))
        meshes: dict[str, LocalMesh] = {}
        for label in args.variants:  # one mesh per variant, started one after another
            meshes[label] = stack.enter_context(
                LocalMesh(mesh_spec(VARIANTS[label][0], model_path, args))
            )
            results["ranker_threads"] = meshes[label].ranker_threads
        chosen = [Variant(label, meshes[label], VARIANTS[label][1]) for label in args.variants]
        for seed in seeds(args):
            rates = sweep(chosen, workload(args), args, seed, max(slo_curve(args)))
            lengths: list[Point] = []
            for variant in chosen:
                if variant.label in args.length_variants:
                    lengths += length_search(variant, seed, args)
            results["seeds"][str(seed)] = {
                "rates": [p.summary() for p in rates],
                "lengths": [p.summary() for p in lengths],
            }
            saved = save_results("relay_bench", args, results, started, results["ranker_threads"])
    return saved


def seeds(args: argparse.Namespace) -> list[int]:
    return [args.seed + i for i in range(args.repeats)]


# -- the verdict (from saved results: --from-json re-renders without running) --------------------


def load_points(saved: dict) -> dict[int, dict[str, list[Point]]]:
    return {
        int(seed): {part: [Point(**p) for p in runs[part]] for part in ("rates", "lengths")}
        for seed, runs in saved["seeds"].items()
    }


def of_label(per_seed: dict[int, dict[str, list[Point]]], part: str, label: str) -> dict:
    return {seed: [p for p in runs[part] if p.label == label] for seed, runs in per_seed.items()}


def best_of(labels: Sequence[str], figure: dict[str, Spread]) -> str | None:
    """The label with the highest median; on a tie the later one (`cache only` before `no
    cache`: the strongest system without the relay is the baseline)."""
    present = [label for label in labels if label in figure]
    if not present:
        return None
    return max(reversed(present), key=lambda label: figure[label].median)


def paired_ratio(relay: dict[int, float], base: dict[int, float]) -> str:
    """Median and range of the per-seed ratio (both variants ran the same trace), and the
    bootstrap 95% interval of that median over seeds."""
    paired = PairedRatios.of(relay, base)
    never = paired.undefined
    if not paired.ratios:
        return "baseline never compliant" if any(relay.values()) else "-"
    text = Spread.of([round(r, 1) for r in paired.ratios.values()]).text("x")
    m = paired.median
    if len(paired.ratios) > 1:
        text += f" (median's 95% CI {m.low:.1f}-{m.high:.1f}x)"
    return text + (f" ({never} seed(s): baseline never compliant)" if never else "")


def per_seed_figure(points: dict[int, list[Point]], slo_ms: float) -> dict[int, float]:
    return {seed: max_compliant(ps, slo_ms) for seed, ps in points.items()}


def best_per_seed(
    rates: dict[str, dict[int, list[Point]]], labels: Sequence[str], slo_ms: float
) -> dict[int, float]:
    """Per seed, the highest compliant throughput among `labels`."""
    seeds = {seed for label in labels for seed in rates[label]}
    return {
        seed: max(max_compliant(rates[label].get(seed, []), slo_ms) for label in labels)
        for seed in sorted(seeds)
    }


def split_row(points: Sequence[Point]) -> str:
    ok = sum(p.ok for p in points)
    relayed = sum(p.relayed for p in points)
    hits = sum(p.hits for p in points)
    errors = sum(sum(p.errors.values()) for p in points)
    refused = sum(p.reasons.get(r, 0) for p in points for r in ("footprint_limit", "load_limit"))
    admitted = sum(relays_admitted(p.reasons) for p in points)
    share = (lambda n: f"{n / ok:.0%}") if ok else (lambda n: "-")
    return (
        f"{ok} | {share(relayed)} | {share(hits - relayed)} | {share(ok - hits)} | {admitted} "
        f"| {refused} | {errors}"
    )


def verdict_line(
    title: str,
    figure: dict[str, Spread],
    per_seed: dict[str, dict[int, float]],
    pair: tuple[str, str],
    unit: str,
    points: dict[str, dict[int, list[Point]]],
) -> str:
    """A headline bullet: the relay's figure against the baseline's, and their paired ratio;
    labelled indicative when a point it rests on holds fewer than 300 Ranks (verdict.ranks_note).
    """
    relay, base = pair
    note = labelled(ranks_note(p.ok for v in pair for ps in points[v].values() for p in ps))
    return (
        f"- **{title}: {relay} {figure[relay].text(unit)} vs {base} {figure[base].text(unit)}; "
        f"per-seed ratio **{paired_ratio(per_seed[relay], per_seed[base])}**.{note}"
    )


def render(saved: dict) -> str:
    args = argparse.Namespace(**saved["args"])
    info, pop = saved["machine"], saved["population"]
    per_seed = load_points(saved)
    labels = [label for label in args.variants if label in VARIANTS]
    rates = {label: of_label(per_seed, "rates", label) for label in labels}
    lengths = {label: of_label(per_seed, "lengths", label) for label in labels}
    curve = slo_curve(args)
    at = {s: {label: compliant_throughput(rates[label], s) for label in labels} for s in curve}
    relay = best_of(RELAYS, at[args.slo_ms])
    base = best_of(BASELINES, at[args.slo_ms])
    longest = {
        label: Spread.of(list(per_seed_figure(lengths[label], args.slo_ms).values()))
        for label in labels
        if any(lengths[label].values())
    }
    long_relay, long_base = best_of(RELAYS, longest), best_of(BASELINES, longest)
    all_points = [p for runs in per_seed.values() for p in runs["rates"]]
    cache_only_points = [p for p in all_points if p.label == CACHE_ONLY]
    m = BENCH_MODEL
    chart_name = f"{result_name('relay_bench', args)}.png"
    headline = []
    if relay and base:
        headline.append(
            verdict_line(
                f"SLO-compliant throughput** at {args.slo_ms:.0f} ms (paper 3.6x; target >= 3.6x, "
                "aim 8x)",
                at[args.slo_ms],
                {label: per_seed_figure(rates[label], args.slo_ms) for label in (relay, base)},
                (relay, base),
                " req/s",
                rates,
            )
        )
    top = max(args.rates)
    if relay and at[args.slo_ms][relay].high >= top:
        headline.append(
            f"  - In some seed the relay met the SLO at the highest rate tried ({top:g} req/s): "
            "its throughput there is a lower bound, and so is the ratio."
        )
    if long_relay and long_base:
        headline.append(
            verdict_line(
                f"Longest sequence** within {args.slo_ms:.0f} ms at {args.length_rate:g} req/s "
                "(paper 1.5x; target >= 1.5x, aim 2x)",
                longest,
                {
                    label: per_seed_figure(lengths[label], args.slo_ms)
                    for label in (long_relay, long_base)
                },
                (long_relay, long_base),
                " tokens",
                lengths,
            )
        )
    if cache_only_points:
        headline.append(
            "- Cross-visit hit rate of `cache only` (measured over all its points): "
            f"{sum(p.hits for p in cache_only_points) / max(1, sum(p.ok for p in cache_only_points)):.0%}."  # noqa: E501
        )
    curve_rows = [
        "| SLO ms | " + " | ".join(labels) + " | best relay vs best non-relay (per seed) |",
        "|---:|" + "---:|" * len(labels) + "---|",
    ]
    for s in curve:
        # Per seed: the best relay of that seed against the best baseline of that seed.
        relays = [label for label in RELAYS if label in rates]
        bases = [label for label in BASELINES if label in rates]
        pair = (
            paired_ratio(best_per_seed(rates, relays, s), best_per_seed(rates, bases, s))
            if relays and bases
            else "-"
        )
        curve_rows.append(
            f"| {s:.0f} | " + " | ".join(at[s][label].text() for label in labels) + f" | {pair} |"
        )
    length_rows = [
        "| variant | longest within SLO, tokens | per seed | lengths tried (P99 ms) |",
        "|---|---:|---|---|",
        *(
            f"| {label} | {longest[label].text()} | "
            + ", ".join(f"{v:g}" for v in per_seed_figure(lengths[label], args.slo_ms).values())
            + " | "
            + "; ".join(
                ", ".join(f"{p.rate:.0f} ({p.p99_ms:.0f})" for p in ps)
                for ps in lengths[label].values()
            )
            + " |"
            for label in longest
        ),
    ]
    split = [
        "| variant | rate req/s | Ranks measured | relayed | cross-visit cache | full inference "
        "| relays admitted | relays refused (footprint/load) | failed Ranks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in labels:
        for rate in sorted({p.rate for p in all_points if p.label == label}):
            same = [p for p in all_points if p.label == label and p.rate == rate]
            split.append(f"| {label} | {rate:g} | {split_row(same)} |")
    detail = [
        "| seed | rate req/s | sent per s | variant | Ranks | P50 ms | P95 ms | P99 ms "
        "| P99 95% CI ms | errors | decisions |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---|---|---|",
    ]
    for seed, runs in per_seed.items():
        for p in sorted(runs["rates"], key=lambda p: (p.rate, labels.index(p.label))):
            errs = ", ".join(f"{k} {v}" for k, v in p.errors.items()) or "-"
            decisions = ", ".join(f"{k} {v}" for k, v in sorted(p.reasons.items())) or "-"
            detail.append(
                f"| {seed} | {p.rate:g} | {p.sent / max(p.duration_s, 1e-9):.2f} | {p.label} "
                f"| {p.ok} | {p.p50_ms:.0f} | {p.p95_ms:.0f} "
                f"| {p.p99_ms:.0f} | {p99_ci(p.latencies_ms)} | {errs} | {decisions} |"
            )
    samples = sorted(p.ok for p in all_points)
    return "\n".join([
        "## Relay race: what the relay adds over the best system without it"
        + (f" ({args.tag})" if args.tag else ""),
        "",
        f"Reproduce: `{saved['command']}`. Chart: [{chart_name}]({chart_name}).",
        "",
        f"- {run_stamp(info)}; {len(per_seed)} seeds ({', '.join(map(str, per_seed))}). One "
        f"local mesh per variant (etcd, two `relaygr ranker` processes on CPU with "
        f"{saved['ranker_threads']} intra-op thread(s) each, router, trigger), measured one at a "
        f"time. Model: {m.num_layers} layers, d_model {m.d_model}; device tier "
        f"{args.hbm_mb} MiB per ranker, host tier {4 * args.hbm_mb} MiB.",
        f"- Population: {pop['users']:,} users (sessions start Zipf s={pop['zipf_s']}; a visit "
        f"returns with p={pop['revisit_p']} after ~{pop['revisit_gap_s']:g} s); long-term "
        f"lengths log-normal, median {pop['median_long_term']} and sigma "
        f"{pop['long_term_sigma']} (mean of Yambda-5B's 4,790 events per user), truncated at "
        f"{pop['max_long_term']}. In {pop['sample_visits']} visits, "
        f"{pop['sample_distinct_users']} distinct users: the tiers hold a small fraction.",
        f"- Traffic: open-loop Poisson visits, max({args.duration:g} s, {args.min_requests} "
        f"requests) per point, first {args.warmup:.0%} excluded (Ranks measured per point: "
        f"{samples[0] if samples else 0}-{samples[-1] if samples else 0}; below 300 the P99 is "
        f"one of the slowest few, so P95 stands beside it); retrieval-to-ranking gap "
        f"{args.gap_ms:.0f} ms; {args.length_requests} requests per length point"
        + (
            f"; {pop['no_show_p']:.0%} of retrievals never ranked (no-shows: their events reach"
            " the trigger, no Rank follows; rates count retrievals)."
            if pop.get("no_show_p")
            else "."
        ),
        f"- SLO: ranking P99 <= {args.slo_ms:.0f} ms from the intended send time, no failed "
        "Rank. Why these proportions: in production the gap and the ranking budget are of the "
        "same order and full inference of the longest histories is over budget. Here full "
        "inference of an 8k history takes ~2.2 s on one core (docs, model_bench) and of the "
        "median history ~0.5 s, so the default SLO and gap sit between them. The trigger calls "
        f"an event at risk above {args.slo_ms - args.margin_ms:.0f} ms of predicted full "
        "inference.",
        "",
        *headline,
        "",
        "**SLO-compliant throughput, req/s** (the highest rate below which every point met the "
        "SLO; median [range] over seeds):",
        "",
        *curve_rows,
        "",
        *([*length_rows, ""] if longest else []),
        "**Where hits came from** (all seeds; relayed: the prefix a PreInfer produced or "
        "pinned for this visit; cross-visit: left by an earlier visit):",
        "",
        *split,
        "",
        "<details><summary>Every rate point</summary>",
        "",
        *detail,
        "",
        "</details>",
    ])  # fmt: skip


def chart(saved: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args = argparse.Namespace(**saved["args"])
    per_seed = load_points(saved)
    labels = [label for label in args.variants if label in VARIANTS]
    curve = slo_curve(args)
    have_lengths = any(runs["lengths"] for runs in per_seed.values())
    panels = 3 if have_lengths else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    load, slos = axes[0], axes[1]
    for label in labels:
        points = [p for runs in per_seed.values() for p in runs["rates"] if p.label == label]
        xs = sorted({p.rate for p in points})
        if xs:
            ys = [Spread.of([p.p99_ms for p in points if p.rate == x]).median for x in xs]
            load.plot(xs, ys, marker="o", label=label)
        rates = of_label(per_seed, "rates", label)
        spreads = [compliant_throughput(rates, s) for s in curve]
        slos.errorbar(
            curve,
            [s.median for s in spreads],
            yerr=[[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]],
            marker="o",
            capsize=3,
            label=label,
        )
    load.axhline(args.slo_ms, color="grey", linestyle="--", label=f"SLO {args.slo_ms:.0f} ms")
    load.set(yscale="log", xlabel="arrival rate (req/s)", ylabel="ranking P99 (ms, median)")
    load.set_title("P99 vs load")
    slos.axvline(args.slo_ms, color="grey", linestyle="--")
    slos.set(xlabel="P99 SLO (ms)", ylabel="SLO-compliant throughput (req/s)")
    slos.set_title("Compliant throughput vs SLO (median, range)")
    if have_lengths:
        bars = axes[2]
        names, meds, errs = [], [], []
        for label in labels:
            found = per_seed_figure(of_label(per_seed, "lengths", label), args.slo_ms)
            if any(of_label(per_seed, "lengths", label).values()):
                s = Spread.of(list(found.values()))
                names.append(label)
                meds.append(s.median)
                errs.append([s.median - s.low, s.high - s.median])
        bars.bar(names, meds, yerr=list(zip(*errs, strict=True)) if errs else None, capsize=4)
        bars.set(ylabel="longest history within SLO (tokens)")
        bars.set_title(f"Longest sequence at {args.length_rate:g} req/s")
        bars.tick_params(axis="x", labelrotation=15)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    load.legend(fontsize=8)
    slos.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_sweep_arguments(parser, [0.5, 1.0, 1.5, 2.0, 3.0])
    add_mesh_arguments(parser)
    parser.set_defaults(min_requests=50, duration=25.0)
    parser.add_argument("--repeats", type=int, default=3, help="seeds: --seed, --seed + 1, ...")
    parser.add_argument(
        "--slos", type=float, nargs="+", default=[1000, 1250, 1500, 2000, 2500, 3000, 4000],
        help="SLOs (ms) of the compliant-throughput curve (--slo-ms is always one of them)",
    )  # fmt: skip
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=[*BASELINES, *RELAYS],
        help="comparison lines (each gets its own mesh)",
    )  # fmt: skip
    parser.add_argument(
        "--length-variants", nargs="*", choices=list(VARIANTS), default=[CACHE_ONLY, *RELAYS],
        help="variants whose longest sequence is searched (none: skip the search)",
    )  # fmt: skip
    parser.add_argument("--length-rate", type=float, default=0.5, help="rate of the length search")
    parser.add_argument("--length-requests", type=int, default=25, help="requests per length")
    parser.add_argument("--length-from", type=int, default=2048, help="first length tried")
    parser.add_argument("--length-max", type=int, default=12288, help="longest length tried")
    args = parser.parse_args()
    if args.from_json is not None:
        saved = load_result(args.from_json)
    else:
        if args.quick:
            args.rates, args.duration, args.min_requests, args.repeats = [1.0, 3.0], 8.0, 0, 1
            args.length_requests, args.length_max = 6, 2048
        saved = run(args)
    saved_args = argparse.Namespace(**saved["args"])
    text = render(saved)
    print(text)
    if not args.no_docs and not saved_args.quick:
        name = result_name("relay_bench", saved_args)
        chart(saved, ROOT / "docs" / f"{name}.png")
        write_section(ROOT / "docs" / "benchmarks.md", name, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
