"""Where the relay pays, simulated: the four variants across SLO, gap, utilisation, no-shows and a
device tier that binds or not, on the H100 and Ascend 910B profiles (issue 26, "the map").

One axis at a time around a centre, plus the corners where the relay room binds. At every point
and seed: each variant's SLO-compliant throughput (a doubling-then-bisecting search over the
offered rate per ranker), its longest history within the SLO (every user of one length, on a
512-token grid, at a fixed light rate), and the shares of Ranks served from a relayed prefix,
from a prefix an earlier visit left (cross-visit) and in full, at its highest compliant rate.
The relay is compared, per seed, with the best non-relay baseline of that seed.

    .venv/bin/python bench/sim_map.py            # the recorded run (docs/benchmarks.md)
    .venv/bin/python bench/sim_map.py --quick    # smoke run: one profile, a tiny grid, not recorded
"""

import argparse
import math
import random
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.pipeline import ROOT, result_name, save_results
from bench.report import add_render_arguments, machine_info, publish, reproduce_lines, run_stamp
from bench.verdict import grid_search, scan_search
from relaygr.bounds import AT_LEAST_ONE, Bound, Bounded
from tooling.local.workload import WorkloadSpec
from tooling.sim.fleet import FleetSettings
from tooling.sim.processes import Processes, add_jobs_arg, jobs_for
from tooling.sim.profile import DeviceProfile, load_profile
from tooling.sim.sweep import BASELINES, RELAYS, VARIANTS, SweepSpec, run_point
from tooling.sim.workload import Visit, light_visits

LENGTH_STEP = 512
PROFILES = ("nvidia-h100", "ascend-910b")
SEARCHES = ("bisect", "scan")
# The centre of the map and each axis's values (one at a time around the centre).
CENTRE: dict[str, Any] = {
    "slo_ms": 40.0,
    "gap_ms": 100.0,
    "utilisation": 0.25,
    "no_show": 0.0,
    "tier": "sized",
}
AXES: dict[str, tuple[Any, ...]] = {
    "slo_ms": (20.0, 30.0, 40.0, 60.0),
    "gap_ms": (20.0, 50.0, 100.0, 200.0),
    "utilisation": (0.20, 0.25, 0.30, 0.40),
    "no_show": (0.0, 0.1, 0.3),
    "tier": ("sized", "binding"),
}
# Where the relay room binds, with what a trigger exists to protect against.
CORNERS: tuple[dict[str, Any], ...] = (
    {"tier": "binding", "no_show": 0.3},
    {"tier": "binding", "gap_ms": 200.0},
)


@dataclass(frozen=True, slots=True)
class MapPoint:
    """One configuration of the map: the centre with some values changed."""

    label: str
    values: dict[str, Any]


def _label(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" if isinstance(v, str) else f"{k}={v:g}" for k, v in values.items())


def map_points(
    axes: dict[str, tuple[Any, ...]], corners: tuple[dict[str, Any], ...]
) -> list[MapPoint]:
    """The centre, each axis's other values one at a time, then the corners."""
    points = [MapPoint("centre", dict(CENTRE))]
    for axis, values in axes.items():
        for value in values:
            if value != CENTRE[axis]:
                points.append(MapPoint(_label({axis: value}), {**CENTRE, axis: value}))
    points += [MapPoint(_label(corner), {**CENTRE, **corner}) for corner in corners]
    return points


def parse(
    argv: list[str] | None = None,
    description: str | None = __doc__,
    options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The map's options; `description`: the --help text of a benchmark that shares them,
    `options` adds that benchmark's own."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if options is not None:
        options(p)
    p.add_argument("--profiles", nargs="+", default=list(PROFILES), help="names under profiles/")
    p.add_argument("--rankers", type=int, default=2)
    p.add_argument("--duration", type=float, default=6.0, help="simulated seconds per point")
    p.add_argument(
        "--min-ranks", type=int, default=300,
        help="counted Ranks a point is drawn to expect at least: a slower point's simulated "
        "span grows past --duration (a P99 of fewer Ranks is its slowest one or two)",
    )  # fmt: skip
    p.add_argument("--users", type=int, default=10_000_000)
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--max-long-term", type=int, default=8192)
    p.add_argument(
        "--gap-sigma", type=float, default=0.5,
        help="log-normal spread of each gap around its median (an assumption)",
    )  # fmt: skip
    p.add_argument("--margin-ms", type=float, default=5.0)
    p.add_argument(
        "--chunk-tokens", type=Bounded(int, AT_LEAST_ONE), default=None,
        help="every ranker's background prefill chunk, tokens, fixed (default: the ranker's"
        " own, RankerConfig.prefill_chunk_tokens grown by prefill_chunk_fixed_share from the"
        " profile's cost)",
    )  # fmt: skip
    p.add_argument(
        "--no-show-prior", type=Bounded(float, Bound(low=0, high=1)), default=None,
        help="the trigger's no_show_prior (default: TriggerConfig's, 1: every relay a no-show"
        " until relays end)",
    )  # fmt: skip
    p.add_argument(
        "--relay-window-ms", type=Bounded(int, AT_LEAST_ONE), default=None,
        help="how long a relay stays pinned awaiting its Rank, as the trigger asks and the"
        " router and rankers default to (default: the services' own, TriggerConfig's)",
    )  # fmt: skip
    p.add_argument(
        "--relay-window-wait-factor", type=Bounded(float, Bound(low=0)), default=None,
        help="the trigger's relay_window_wait_factor: a relay asks for this many times its"
        " ranker's reported relay-wait tail, at most the relay window (default: TriggerConfig's)",
    )  # fmt: skip
    p.add_argument(
        "--relay-spare-share", type=Bounded(float, Bound(low=0, high=1)), default=None,
        help="the trigger's relay_spare_share: a relay not at risk goes while its ranker's room"
        " is less than this full (0: relay only what is at risk; default: TriggerConfig's)",
    )  # fmt: skip
    p.add_argument(
        "--observe-ms", type=int, default=100,
        help="how often the trigger and router read the rankers' Describe (room and queues)",
    )  # fmt: skip
    p.add_argument(
        "--binding-tier-mib", type=float, default=2048.0,
        help="the device tier of the 'binding' points, MiB per ranker",
    )  # fmt: skip
    p.add_argument(
        "--rate-step", type=float, default=2.5, help="req/s per ranker: the rate search's grid"
    )
    p.add_argument("--rate-max", type=float, default=160.0, help="req/s per ranker searched to")
    p.add_argument(
        "--search", choices=SEARCHES, default="bisect",
        help="how compliant throughput is searched: 'bisect' doubles the rate and bisects it "
        "(assumes a P99 monotone in the rate); 'scan' runs every grid rate from the lowest up "
        "to the first that fails, the highest rate below which every rate passes",
    )  # fmt: skip
    p.add_argument(
        "--length-rate", type=float, default=5.0, help="req/s per ranker of the length search"
    )
    p.add_argument("--length-max", type=int, default=32768)
    p.add_argument("--axes", nargs="+", default=list(AXES), help=f"of: {', '.join(AXES)}")
    p.add_argument("--no-corners", action="store_true", help="leave the binding corners out")
    p.add_argument(
        "--points", nargs="+", default=None, metavar="LABEL",
        help="only the points of these labels (as the results name them, e.g. 'tier=binding"
        " no_show=0.3'; default: all)",
    )  # fmt: skip
    p.add_argument("--seeds", type=int, default=5, help="seeds from --seed on")
    p.add_argument("--seed", type=int, default=None, help="first seed (default: random)")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny grid, one seed")
    p.add_argument("--tag", default="", help="suffix of the result file and docs section")
    add_jobs_arg(p.add_argument_group("runs"), "points x seeds")
    add_render_arguments(p)
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**32)
    if args.quick:
        args.profiles, args.seeds, args.duration = args.profiles[:1], 1, 3.0
        args.min_ranks = 30
        args.axes, args.no_corners = ["tier"], True
        args.rate_step, args.rate_max, args.length_max = 10.0, 40.0, 2048
        args.users = 100_000
    return args


def chosen(args: argparse.Namespace, points: list[MapPoint]) -> list[MapPoint]:
    """`points` labelled in --points (all without it); a label none has is an error."""
    if args.points is None:
        return points
    unknown = set(args.points) - {p.label for p in points}
    if unknown:
        raise SystemExit(f"no such point: {', '.join(sorted(unknown))}")
    return [p for p in points if p.label in args.points]


def point_profile(base: DeviceProfile, values: dict[str, Any], binding_mib: float) -> DeviceProfile:
    profile = base.at_utilisation(values["utilisation"])
    if values["tier"] == "binding":
        profile = profile.with_memory(int(binding_mib * 2**20))
    return profile


def point_spec(
    args: argparse.Namespace, base: DeviceProfile, values: dict[str, Any], seed: int
) -> SweepSpec:
    workload = WorkloadSpec(
        users=args.users,
        max_long_term=args.max_long_term,
        candidates=args.candidates,
        gap_s=values["gap_ms"] / 1e3,
        gap_sigma=args.gap_sigma,
        no_show_p=values["no_show"],
    )
    slo = values["slo_ms"]
    margin = min(args.margin_ms, slo / 4)
    fleet = FleetSettings.serving(args.rankers, slo, margin, values["gap_ms"])
    knobs = {  # the trigger's knobs a run may set; unset (None): TriggerConfig's own
        "no_show_prior": args.no_show_prior,
        "relay_window_wait_factor": args.relay_window_wait_factor,
        "relay_spare_share": args.relay_spare_share,
    }
    set_knobs = {name: value for name, value in knobs.items() if value is not None}
    fleet = replace(
        fleet,
        trigger=replace(fleet.trigger, observe_interval_ms=args.observe_ms, **set_knobs),
        router=replace(fleet.router, observe_interval_ms=args.observe_ms),
    )
    if args.relay_window_ms is not None:
        fleet = fleet.with_relay_window(args.relay_window_ms)
    if args.chunk_tokens is not None:
        ranker = replace(
            fleet.ranker, prefill_chunk_tokens=args.chunk_tokens, prefill_chunk_fixed_share=1.0
        )
        fleet = replace(fleet, ranker=ranker)
    profile = point_profile(base, values, args.binding_tier_mib)
    return SweepSpec(profile, fleet, workload, (), args.duration, (seed,))


def point_span(args: argparse.Namespace, spec: SweepSpec, rate: float) -> float:
    """Simulated seconds of a point at `rate` (req/s over the fleet): --duration, or longer
    where that span would count fewer than --min-ranks Ranks expected (the first `warmup` share
    is not counted, and a no-show never ranks)."""
    ranked_per_s = rate * (1 - spec.warmup) * (1 - spec.workload.no_show_p)
    return max(spec.duration_s, args.min_ranks / ranked_per_s)


def shares(summary: dict[str, Any]) -> dict[str, float]:
    return {
        "relayed": summary["relayed_ratio"],
        "cross_visit": summary["cached_ratio"],
        "full": 1.0 - summary["hit_ratio"],
    }


def search_variant(
    args: argparse.Namespace,
    spec: SweepSpec,
    variant: str,
    seed: int,
    visits_at: Callable[[float], list[Visit]],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """`variant`'s compliant throughput, its shares there, and its longest sequence."""
    slo = spec.slo_ms
    seen: dict[float, dict[str, Any]] = {}

    def passes_rate(units: int) -> bool:
        per_ranker = units * args.rate_step
        rate = per_ranker * args.rankers
        span = point_span(args, spec, rate)
        done = run_point(spec, variant, rate, seed, visits_at(rate), span)
        seen[per_ranker] = done.summary(slo)
        ok = done.point.compliant(slo)
        verdict = "ok" if ok else "--"
        log(f"{variant:>22} {per_ranker:6g}/s/ranker p99 {done.point.p99_ms:8.1f} ms {verdict}")
        return ok

    search = scan_search if args.search == "scan" else grid_search
    units, _ = search(1, int(args.rate_max / args.rate_step), 1, passes_rate)
    compliant = units * args.rate_step
    at = seen[compliant] if units else seen[min(seen)]

    def passes_length(length: int) -> bool:
        fixed = replace(
            spec.workload, median_long_term=length, long_term_sigma=0.0,
            min_long_term=length, max_long_term=length, user_prefix=f"L{length}",
        )  # fmt: skip
        rate = args.length_rate * args.rankers
        at_length = replace(spec, workload=fixed)
        span = point_span(args, at_length, rate)
        visits = light_visits(fixed, rate, span, seed)
        done = run_point(at_length, variant, rate, seed, visits, span)
        return done.point.compliant(slo)

    longest, _ = grid_search(LENGTH_STEP, args.length_max, LENGTH_STEP, passes_length)
    log(f"{variant:>22} compliant {compliant:g}/s/ranker, longest {longest}")
    return {
        "compliant_per_ranker": compliant,
        "longest": longest,
        "shares": shares(at),
        "p99_ms_at_compliant": at["p99_ms"],
        "relays_refused": at["fleet"]["relays_refused"],
        "reasons": at["reasons"],
    }


def tier_mib(name: str) -> float:
    """The profile's own (sized) device tier, MiB."""
    return load_profile(ROOT / "profiles" / f"{name}.toml").device_tier_bytes / 2**20


def measure_point(
    args: argparse.Namespace,
    name: str,
    base: DeviceProfile,
    point: MapPoint,
    seed: int,
    systems: Mapping[str, tuple[str, bool]] | None = None,
) -> list[dict[str, Any]]:
    """The four variants at one point and seed, on the same visits. `systems`: instead, label
    -> (variant, whether its trigger is told the no-shows: `FleetSettings.no_show_oracle`)."""
    spec = point_spec(args, base, point.values, seed)
    drawn: dict[float, list[Visit]] = {}

    def visits_at(rate: float) -> list[Visit]:
        if rate not in drawn:
            drawn[rate] = light_visits(spec.workload, rate, point_span(args, spec, rate), seed)
        return drawn[rate]

    def log(text: str) -> None:
        print(f"{name} {point.label:>22} seed {seed}: {text}", flush=True)

    systems = {v: (v, False) for v in VARIANTS} if systems is None else systems
    rows = []
    for label, (variant, oracle) in systems.items():
        told = replace(spec, fleet=replace(spec.fleet, no_show_oracle=oracle))
        found = search_variant(args, told, variant, seed, visits_at, log)
        rows.append({
            "profile": name, "point": point.label, "values": point.values, "seed": seed,
            "variant": label, **found,
        })  # fmt: skip
    return rows


MeasureOne = Callable[[argparse.Namespace, str, DeviceProfile, MapPoint, int], list[dict[str, Any]]]


def profile_rows(
    args: argparse.Namespace,
    name: str,
    points: list[MapPoint],
    seeds: list[int],
    measure_one: MeasureOne = measure_point,
) -> list[dict[str, Any]]:
    """Every point x seed on the profile `name` (under profiles/), each measured by
    `measure_one` (default `measure_point`: the four variants), `args.jobs` of them at once
    (`tooling.sim.processes`), the rows in the same order whatever the count."""
    base = load_profile(ROOT / "profiles" / f"{name}.toml")
    asks = [(args, name, base, point, seed) for point in points for seed in seeds]
    with Processes(measure_one, jobs_for(args.jobs, len(asks))) as runs:
        return [row for rows in runs.each(asks) for row in rows]


def measure(
    args: argparse.Namespace, done: Callable[[dict[str, Any]], None] = lambda _: None
) -> dict[str, Any]:
    """Every profile x map point x seed x variant; what `run` saves. `done` hears the results
    so far after each profile (a long run keeps what it finished)."""
    stamp = machine_info(threads=1)  # the commit the run starts from
    seeds = [args.seed + i for i in range(args.seeds)]
    axes = {k: AXES[k] for k in args.axes}
    points = chosen(args, map_points(axes, () if args.no_corners else CORNERS))
    rows: list[dict[str, Any]] = []
    for name in args.profiles:
        rows += profile_rows(args, name, points, seeds)
        finished = sorted({r["profile"] for r in rows}, key=args.profiles.index)
        results = {
            "machine": stamp,
            "seeds": seeds,
            "points": [p.label for p in points],
            "profiles": {n: {"device_tier_mib": tier_mib(n)} for n in finished},
            "rows": rows,
        }
        done(results)
    return results


def run(args: argparse.Namespace) -> dict:
    started = machine_info(threads=1)  # the commit the run starts from

    def keep(partial: dict[str, Any]) -> None:
        save_results("sim_map", args, partial, started, threads=1)

    saved = save_results("sim_map", args, measure(args, keep), started, threads=1)
    if not args.quick:
        for name in args.profiles:
            chart(saved, name, ROOT / "docs" / chart_name(saved, name))
    return saved


# -- rendering --------------------------------------------------------------------------------


def search_words(a: dict[str, Any]) -> str:
    """How a run searched compliant throughput, for its section (nothing for `bisect`, the
    default, which runs before `--search` existed used)."""
    if a.get("search", "bisect") == "scan":
        return (
            ", scanned (every rate from the lowest up to the first that fails: the highest rate"
            " below which every rate passes)"
        )
    return ""


def chart_name(saved: dict, profile: str) -> str:
    """The chart of `profile` in docs/: a tagged run's beside the untagged run's."""
    tag = saved.get("args", {}).get("tag", "")
    return f"sim_map_{profile}{f'_{tag}' if tag else ''}.png"


def _by(saved: dict, profile: str, point: str) -> dict[str, dict[int, dict[str, Any]]]:
    """variant -> seed -> row, at one profile and point."""
    out: dict[str, dict[int, dict[str, Any]]] = {v: {} for v in VARIANTS}
    for row in saved["rows"]:
        if row["profile"] == profile and row["point"] == point:
            out[row["variant"]][row["seed"]] = row
    return out


def ratio(a: float, b: float) -> float | None:
    """a / b; infinite when only b is 0 (only a complies); None when both are (neither does)."""
    if b == 0:
        return None if a == 0 else math.inf
    return a / b


def ratios(
    by: dict[str, dict[int, dict[str, Any]]], seeds: list[int], key: str
) -> list[float | None]:
    """Per seed, the best relay's `key` over the best non-relay baseline's (`ratio`)."""
    return [
        ratio(max(by[v][s][key] for v in RELAYS), max(by[v][s][key] for v in BASELINES))
        for s in seeds
    ]


def aware_vs_all(by: dict[str, dict[int, dict[str, Any]]], seeds: list[int]) -> list[float | None]:
    key = "compliant_per_ranker"
    return [ratio(by["relay sequence-aware"][s][key], by["relay all"][s][key]) for s in seeds]


def spread(values: list[float | None], fmt: str = "{:.2f}") -> str:
    """Median [low-high] over the seeds where either side complied ("inf": only the first
    did); "neither" when it was none, and how many seeds neither did otherwise."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return "neither"

    def show(v: float) -> str:
        return "inf" if v == math.inf else fmt.format(v)

    mid, low, high = show(statistics.median(known)), show(known[0]), show(known[-1])
    text = mid if low == high else f"{mid} [{low}-{high}]"
    unknown = len(values) - len(known)
    return f"{text} ({unknown} seed{'s' if unknown > 1 else ''}: neither)" if unknown else text


def medians(values: list[float | None]) -> tuple[float, float] | None:
    """(median, lowest) of the seeds where either side complied; None when none did."""
    known = sorted(v for v in values if v is not None)
    return (statistics.median(known), known[0]) if known else None


def median_of(by: dict[str, dict[int, dict[str, Any]]], variant: str, key: str) -> float:
    return statistics.median(r[key] for r in by[variant].values())


def render(saved: dict) -> str:
    a = saved["args"]
    seeds = saved["seeds"]
    lines = [
        "## The map: where the relay pays (simulated)",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])} (stamped at the run's start). Simulated "
        "(`tooling.sim`), not measured: profiles of cited figures and labelled assumptions "
        "(profiles/README.md).",
        f"- Fleet: {a['rankers']} rankers; {a['users']:,} users, Yambda-matched lengths capped "
        f"at {a['max_long_term']:,}; {a['candidates']} candidates; each gap log-normal around "
        f"its median with sigma {a['gap_sigma']:g} (an assumption); at-risk margin "
        f"min({a['margin_ms']:g} ms, SLO/4); Describe read every {a['observe_ms']} ms; "
        f"{a['duration']:g} s per point, longer where that would count fewer than "
        f"{a['min_ranks']} Ranks (first 20% not counted); seeds {', '.join(map(str, seeds))}.",
        f"- Centre: SLO {CENTRE['slo_ms']:g} ms, gap median {CENTRE['gap_ms']:g} ms, "
        f"utilisation {CENTRE['utilisation']:g}, no-shows {CENTRE['no_show']:g}, the "
        f"profile's device tier (sized); 'binding': {a['binding_tier_mib']:,.0f} MiB per ranker. "
        "One axis at a time around it, then the binding corners.",
        f"- Compliant throughput: req/s per ranker (retrievals offered), P99 within the SLO "
        f"and no failure, searched on a {a['rate_step']:g} req/s grid up to {a['rate_max']:g} "
        f"({a['rate_max']:g}: at least that){search_words(a)}. "
        f"Longest sequence: every user of one length at {a['length_rate']:g} req/s per ranker, "
        f"{LENGTH_STEP}-token grid up to {a['length_max']:,}. Ratios are per seed, the best "
        "relay over the best non-relay baseline of that seed; median [range]; inf: only the "
        "relay complied; neither: no variant complied at any rate searched. Shares: of the "
        "sequence-aware variant's Ranks at its highest compliant rate (relayed / cross-visit "
        "/ full). A P99 here rests on a few hundred Ranks per point: indicative.",
        "",
    ]
    not_paying: list[str] = []  # the median seed's relay at most its best baseline
    not_every_seed: list[str] = []  # pays at the median seed, not in every seed
    neither: list[str] = []  # no variant complies at any rate searched
    for profile in saved["profiles"]:  # those finished
        tier = saved["profiles"][profile]["device_tier_mib"]
        lines += [
            f"### {profile} (device tier {tier:,.0f} MiB when sized)",
            "",
            f"![map {profile}]({chart_name(saved, profile)})",
            "",
            "| point | no cache | cache only | relay all | seq-aware | relay / best baseline "
            "| seq-aware / relay all | longest: base / relay | longest ratio | shares "
            "(relayed / cross / full) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for point in saved["points"]:
            by = _by(saved, profile, point)
            if not all(by[v] for v in VARIANTS):
                continue
            thr = [f"{median_of(by, v, 'compliant_per_ranker'):g}" for v in VARIANTS]
            r = ratios(by, seeds, "compliant_per_ranker")
            lr = ratios(by, seeds, "longest")
            best_base_len = statistics.median(
                max(by[v][s]["longest"] for v in BASELINES) for s in seeds
            )
            best_relay_len = statistics.median(
                max(by[v][s]["longest"] for v in RELAYS) for s in seeds
            )
            sh = [r_["shares"] for r_ in by["relay sequence-aware"].values()]
            share = " / ".join(
                f"{statistics.median(x[k] for x in sh):.0%}"
                for k in ("relayed", "cross_visit", "full")
            )
            lines.append(
                f"| {point} | {' | '.join(thr)} | {spread(r)} | {spread(aware_vs_all(by, seeds))} "
                f"| {best_base_len:g} / {best_relay_len:g} | {spread(lr)} | {share} |"
            )
            summary = medians(r)
            if summary is None:
                neither.append(f"{profile} at {point}")
            elif summary[0] <= 1.0:
                not_paying.append(f"{profile} at {point} ({spread(r)})")
            elif summary[1] <= 1.0:
                not_every_seed.append(f"{profile} at {point} ({spread(r)})")
        lines.append("")

    aware, cache = [], []
    for profile in saved["profiles"]:
        for point in saved["points"]:
            by = _by(saved, profile, point)
            if all(by[v] for v in VARIANTS):
                found = medians(aware_vs_all(by, seeds))
                if found is not None:
                    aware.append(found[0])
                c = medians(
                    [ratio(by["cache only"][s]["compliant_per_ranker"],
                           by["no cache"][s]["compliant_per_ranker"]) for s in seeds]
                )  # fmt: skip
                if c is not None:
                    cache.append(c[0])
    lines += [
        f"**The trigger**: sequence-aware over relay all, median seed, at least 0.95x at "
        f"{sum(x >= 0.95 for x in aware)} of {len(aware)} points where either complies "
        f"(median over points {statistics.median(aware) if aware else 0:.2f}x).",
        "",
        f"**Cache only against no cache**: at least 1x at {sum(x >= 1 for x in cache)} of "
        f"{len(cache)} points where either complies (median over points "
        f"{statistics.median(cache) if cache else 0:.2f}x).",
        "",
    ]

    def listed(items: list[str]) -> str:
        return "; ".join(items) if items else "nowhere on this grid"

    lines += [
        "**Where the relay does not pay** (compliant throughput, best relay over best "
        f"baseline, at most 1x at the median seed): {listed(not_paying)}.",
        "",
        f"**Where it pays at the median seed but not in every seed**: {listed(not_every_seed)}.",
        "",
        "**Where no variant complies at any rate searched** (the SLO is below what even a "
        f"relayed Rank of the longest histories takes; only the longest-sequence columns "
        f"speak): {listed(neither)}.",
    ]
    return "\n".join(lines) + "\n"


def chart(saved: dict, profile: str, path: Path) -> None:
    """Per point, the best relay over the best baseline and sequence-aware over relay all
    (compliant throughput): median and per-seed range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = saved["seeds"]
    cap = 10.0  # an infinite ratio (only the numerator complied) is drawn at the cap
    series: dict[str, Callable[[dict[str, dict[int, dict[str, Any]]]], list[float | None]]] = {
        "best relay / best baseline": lambda by: ratios(by, seeds, "compliant_per_ranker"),
        "sequence-aware / relay all": lambda by: aware_vs_all(by, seeds),
    }
    points = [p for p in saved["points"] if all(_by(saved, profile, p)[v] for v in VARIANTS)]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    for offset, (name, of) in zip((-0.12, 0.12), series.items(), strict=True):
        xs, mids, lows, highs = [], [], [], []
        for i, point in enumerate(points):
            r = [min(x, cap) for x in of(_by(saved, profile, point)) if x is not None]
            if not r:
                continue  # neither side complied: no ratio to draw
            mid = statistics.median(r)
            xs.append(i + offset)
            mids.append(mid)
            lows.append(mid - min(r))
            highs.append(max(r) - mid)
        ax.errorbar(xs, mids, yerr=[lows, highs], fmt="o", capsize=3, label=name)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(points)), points, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(f"compliant throughput ratio ({cap:g}: only the first complies)", fontsize=8)
    ax.set_title(f"{profile}: median and range over {len(seeds)} seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    args = parse()
    name = result_name("sim_map", args)
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
