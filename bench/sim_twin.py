"""A mesh point of the relay benchmark, replayed in the simulator over many seeds.

The mesh gives three seeds a point in about an hour; its simulated twin gives ten in a minute,
enough to see which way a change goes before the mesh confirms it. Per seed, each variant gets
the relay benchmark's own trace (`bench.pipeline.population`, `point_schedule` and
`follow_of`: the same arrivals, gaps and no-shows the mesh is driven with) and configuration
(the services' configurations parsed from the flags `bench.relay_bench.mesh_spec` gives the
mesh's processes), on the mesh's measured CPU profile: the one a stored simulator validation
read from the rankers' Describe (`bench/results/sim_validate.json`), with the device tier of
`--hbm-mb` and the mesh's host tier (4x). What it cannot show is what the validation measures:
the simulator's P99 runs below the mesh's where the mesh's processes share cores.

    .venv/bin/python bench/sim_twin.py --no-show 0.33 --hbm-mb 24 --rate 1.5 --tag no_shows
"""

import argparse
import dataclasses
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from bench.pipeline import (
    ROOT,
    add_sweep_arguments,
    follow_of,
    point_schedule,
    population,
    result_name,
    save_results,
)
from bench.relay_bench import VARIANTS, add_mesh_arguments, mesh_spec, workload
from bench.report import load_result, machine_info, publish, reproduce_lines, run_stamp
from bench.sim_validate import fleet_settings
from relaygr.cost import CostModel
from tooling.local.drive import Point
from tooling.sim.fleet import run_visits
from tooling.sim.profile import DeviceProfile
from tooling.sim.workload import visits_of

SYSTEMS = ("no cache", "cache only", "relay all", "relay sequence-aware")
PAIRS = (
    ("cache only", "no cache"),
    ("relay sequence-aware", "relay all"),
    ("relay all", "cache only"),
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_sweep_arguments(p, [1.5])
    add_mesh_arguments(p)
    p.set_defaults(duration=270.0)
    p.add_argument("--seeds", type=int, default=10, help="seeds from --seed on")
    p.add_argument(
        "--profile-from", type=Path, default=ROOT / "bench" / "results" / "sim_validate.json",
        help="a stored simulator validation whose first seed's measured profile is used",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.duration = 2, 60.0
    return args


def measured_profile(path: Path, hbm_mb: int) -> DeviceProfile:
    """The mesh's measured CPU profile from a stored validation, with the benchmark's tiers."""
    saved = load_result(path)
    first = next(iter(saved["seeds"].values()))
    raw = first["relay sequence-aware"]["profile"]
    fields = {f.name for f in dataclasses.fields(CostModel)}
    cost = CostModel(**{k: v for k, v in raw["cost"].items() if k in fields})
    return DeviceProfile(
        name=raw["name"],
        cost=cost,
        device_tier_bytes=hbm_mb << 20,
        host_tier_bytes=4 * hbm_mb << 20,
        kv_bytes_per_token=raw["kv_bytes_per_token"],
        request_overhead_ms=raw["request_overhead_ms"],
        compute_noise=raw["compute_noise"],
        kind="measured",
        description=raw["description"],
    )


def run_one(
    args: argparse.Namespace, profile: DeviceProfile, seed: int, rate: float, label: str
) -> Point:
    """One variant's point of one seed through a fresh simulated fleet."""
    kind, mode = VARIANTS[label]
    # The simulator runs the profile, not the model: the mesh flags' model path is never read.
    settings = fleet_settings(mesh_spec(kind, Path("model.json"), args), mode, args)
    pop = population(label, workload(args), seed)
    arrivals, warmup_s = point_schedule(pop, rate, args)
    records, _ = run_visits(profile, settings, visits_of(arrivals, follow_of(pop, arrivals)), seed)
    return Point.of(label, rate, arrivals, records, warmup_s)


def run(args: argparse.Namespace) -> dict[str, Any]:
    stamp = machine_info()  # the commit this run measures, stamped before it runs
    profile = measured_profile(args.profile_from, args.hbm_mb)
    rows = []
    for seed in range(args.seed, args.seed + args.seeds):
        for rate in args.rates:
            for label in SYSTEMS:
                point = run_one(args, profile, seed, rate, label)
                rows.append({"seed": seed, **point.summary()})
                print(
                    f"{seed} {rate:g}/s {label:>22}: n {point.ok}  P99 {point.p99_ms:6.0f} ms  "
                    f"relayed {point.relayed_ratio:.0%}  {dict(point.reasons)}",
                    flush=True,
                )
    saved: dict[str, object] = {"rows": rows, "profile": dataclasses.asdict(profile)}
    return save_results("sim_twin", args, saved, stamp, threads=1)


def render(saved: dict[str, Any]) -> str:
    a = saved["args"]
    points = {
        (r["seed"], r["rate"], r["label"]): Point(**{k: v for k, v in r.items() if k != "seed"})
        for r in saved["rows"]
    }
    seeds = sorted({seed for seed, _, _ in points})
    tag = f" ({a['tag']})" if a["tag"] else ""
    lines = [
        f"## The mesh point's simulated twin{tag}",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. Simulated (`tooling.sim`), not measured: the relay "
        f"benchmark's trace and configuration, {a['no_show']:.0%} of retrievals never ranked, "
        f"a {a['hbm_mb']} MiB device tier, gap {a['gap_ms']:g} ms, SLO {a['slo_ms']:g} ms, "
        f"{a['duration']:g} s per point (first {a['warmup']:.0%} not counted), {len(seeds)} "
        f"seeds from {seeds[0]}; profile: {saved['profile']['description']}.",
    ]
    for rate in a["rates"]:
        lines += [
            "",
            f"**{rate:g} retrievals/s.**",
            "",
            "| variant | P99 ms, median [range] over seeds | Ranks a point | relayed, median | "
            "decisions (all seeds) |",
            "|---|---:|---:|---:|---|",
        ]
        for label in SYSTEMS:
            mine = [points[s, rate, label] for s in seeds]
            p99 = [p.p99_ms for p in mine]
            reasons: Counter[str] = Counter()
            for p in mine:
                reasons.update(p.reasons)
            lines.append(
                f"| {label} | {statistics.median(p99):,.0f} [{min(p99):,.0f}-{max(p99):,.0f}] | "
                f"{min(p.ok for p in mine)}-{max(p.ok for p in mine)} | "
                f"{statistics.median(p.relayed_ratio for p in mine):.0%} | "
                + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
                + " |"
            )
        lines += ["", "Paired per seed (P99; lower is better):", ""]
        for ours_label, theirs in PAIRS:
            ours = [points[s, rate, ours_label].p99_ms for s in seeds]
            base = [points[s, rate, theirs].p99_ms for s in seeds]
            ratios = [b / o for o, b in zip(ours, base, strict=True)]
            lower = sum(o <= b for o, b in zip(ours, base, strict=True))
            lines.append(
                f"- {ours_label} against {theirs}: at or below it in {lower} of {len(seeds)} "
                "seeds; "
                f"{theirs}'s P99 over {ours_label}'s {statistics.median(ratios):.2f}x "
                f"[{min(ratios):.2f}-{max(ratios):.2f}]."
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse()
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", result_name("sim_twin", args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
