"""How far the trigger could go over relaying everything where the room or no-shows bind (issue 26).

Issue 26 asks the sequence-aware trigger for 1.3x relay all's compliant throughput where the relay
room or no-shows bind. This measures, side by side on the map's points where they do
(`bench/sim_map.py`: the same profiles, workload, fleet, seeds and searches), the two relays as
built beside two references that no trigger can be:

- **told the no-shows** (points with no-shows): each relay with a trigger that never sees a
  retrieval whose Rank will not come (`FleetSettings.no_show_oracle`). At retrieval time a
  no-show (filtered, abandoned) looks like any other request, so the better told relay over
  relay all bounds what sparing the no-shows can gain: where it stays under the target, no
  trigger reaches the target that way.
- **relay all, its room sized** (points where the tier binds): relay all with the profile's own
  device tier, where the room does not bind: what the binding room costs relaying everything,
  all of which a perfect choice among relays could at most win back (a reference, not a bound:
  a trigger also decides what not to prefill, which at the map's centre gains nothing, 1.00x).

Ratios per seed over relay all at the same point.

    .venv/bin/python bench/sim_bound.py --seed 20261204      # the recorded run (~10 minutes)
"""

import argparse
import statistics
from typing import Any

from bench.pipeline import ROOT, result_name, save_results
from bench.report import machine_info, publish, reproduce_lines, run_stamp
from bench.sim_map import (
    AXES,
    CORNERS,
    MapPoint,
    chosen,
    map_points,
    measure_point,
    parse,
    profile_rows,
    ratio,
    search_words,
    spread,
)
from tooling.sim.profile import DeviceProfile
from tooling.sim.sweep import RELAYS

AWARE = "relay sequence-aware"
TOLD = " told the no-shows"
SIZED = "relay all, its room sized"
BEST_TOLD = "best told"  # per seed, the better of the two relays told the no-shows
TARGET = 1.3  # issue 26: the trigger over relay all where the room or no-shows bind
NAME = "sim_bound"


def bound_points() -> list[MapPoint]:
    """The map's points where the relay room binds or some retrievals never rank."""
    return [
        p
        for p in map_points(AXES, CORNERS)
        if p.values["tier"] == "binding" or p.values["no_show"] > 0
    ]


def systems_at(point: MapPoint) -> dict[str, tuple[str, bool]]:
    """label -> (variant, told the no-shows) at `point`, its room as the point has it."""
    systems = {v: (v, False) for v in RELAYS}
    if point.values["no_show"] > 0:
        systems |= {f"{v}{TOLD}": (v, True) for v in RELAYS}
    return systems


def measure_bound_point(
    args: argparse.Namespace, name: str, base: DeviceProfile, point: MapPoint, seed: int
) -> list[dict[str, Any]]:
    """Every system of `point` at one seed, each on the same visits; where the tier binds,
    relay all with the sized tier as well (its row keeps the point's label and the values it
    ran with)."""
    rows = measure_point(args, name, base, point, seed, systems_at(point))
    if point.values["tier"] == "binding":
        sized = MapPoint(point.label, {**point.values, "tier": "sized"})
        rows += measure_point(args, name, base, sized, seed, {SIZED: ("relay all", False)})
    return rows


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Each profile x point (`bound_points`, or those of --points) x seed. The options are the
    map's (`bench/sim_map.py --help`)."""
    stamp = machine_info(threads=1)
    seeds = [args.seed + i for i in range(args.seeds)]
    points = chosen(args, bound_points())
    rows = [
        row
        for name in args.profiles
        for row in profile_rows(args, name, points, seeds, measure_bound_point)
    ]
    return {"machine": stamp, "seeds": seeds, "points": [p.label for p in points], "rows": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = machine_info(threads=1)  # the commit the run starts from
    return save_results(NAME, args, measure(args), started, threads=1)


def over_all(by: dict[str, dict[int, float]], seeds: list[int], system: str) -> list[float | None]:
    """Per seed, `system`'s compliant throughput over relay all's (`sim_map.ratio`: infinite
    when only `system` complies, None when neither does)."""
    return [ratio(by[system][s], by["relay all"][s]) for s in seeds]


def reached(values: list[float | None]) -> str:
    return f"{sum(v is not None and v >= TARGET for v in values)} of {len(values)}"


def render(saved: dict[str, Any]) -> str:
    a = saved["args"]
    seeds = saved["seeds"]
    lines = [
        "## How far the trigger could go over relay all where the room or no-shows bind "
        "(simulated)",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])} (stamped at the run's start). The map's points where "
        f"the relay room binds or retrievals never rank (`bench/sim_map.py`: its workload, "
        f"{a['rankers']} rankers, compliant throughput searched on a {a['rate_step']:g} "
        f"req/s-per-ranker grid{search_words(a)}, {a['duration']:g} simulated seconds a point, "
        f"longer where that would count fewer than {a['min_ranks']} Ranks), seeds "
        f"{', '.join(str(s) for s in seeds)}.",
        f"- **Told the no-shows**: the trigger never sees a retrieval whose Rank will not come "
        f"(`FleetSettings.no_show_oracle`), which no trigger can do. The better told relay over "
        f"relay all bounds what sparing the no-shows can gain. **Room sized**: relay all with "
        f"the profile's own device tier, where the room does not bind: what the binding room "
        f"costs relaying everything (a reference, not a bound). Ratios per seed over relay all, "
        f"median [lowest-highest]; the issue's target is {TARGET:g}x.",
        "",
        "| profile | point | relay all | sequence-aware | best told | room sized "
        "| sequence-aware / relay all (seeds at target) | best told / relay all (seeds at target) "
        "| room sized / relay all (seeds at target) |",
        "|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    for profile in a["profiles"]:
        for point in saved["points"]:
            by: dict[str, dict[int, float]] = {}
            for row in saved["rows"]:
                if row["profile"] == profile and row["point"] == point:
                    by.setdefault(row["variant"], {})[row["seed"]] = row["compliant_per_ranker"]
            if not all(len(by.get(v, {})) == len(seeds) for v in RELAYS):
                continue
            told = all(f"{v}{TOLD}" in by for v in RELAYS)
            if told:
                by[BEST_TOLD] = {s: max(by[f"{v}{TOLD}"][s] for v in RELAYS) for s in seeds}
            cells = [
                f"{statistics.median(by[v].values()):g}" if v in by else "-"
                for v in ("relay all", AWARE, BEST_TOLD, SIZED)
            ]
            ratios = [
                f"{spread(over_all(by, seeds, v))} ({reached(over_all(by, seeds, v))})"
                if v in by
                else "-"
                for v in (AWARE, BEST_TOLD, SIZED)
            ]
            lines.append(f"| {profile} | {point} | {' | '.join(cells + ratios)} |")
    return "\n".join(lines)


def main() -> int:
    args = parse(description=__doc__)
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", result_name(NAME, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
