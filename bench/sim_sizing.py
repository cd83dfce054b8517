"""Sizing a fleet of 1,000 rankers and 10^8 users with the simulator (docs/sizing.md).

A fleet of N rankers at r req/s each is simulated as a slice of k rankers at k*r req/s over k/N
of the population: rendezvous hashing spreads users, and so load, evenly, and every per-ranker
quantity (latency, hits, memory, directory writes per ranker) is the slice's; fleet totals are
the slice's times N/k. What the slice costs is measured where both can run: a fleet of
`--check-fleet` rankers in full against a slice of it. Scenarios, each from the same seed:
steady state, one ranker killed, a rolling restart of every ranker, a 10% scale-out.

    .venv/bin/python bench/sim_sizing.py            # the full run (docs/sizing.md)
    .venv/bin/python bench/sim_sizing.py --quick    # smoke run, not recorded in docs
"""

import argparse
import resource
import tracemalloc
from dataclasses import replace
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
from bench.verdict import seeds_note
from relaygr.cluster import PlacementRecord
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.membership_directory import EtcdMembershipDirectory, entry_value
from relaygr.etcd.watch import EventKind, WatchEvent
from services.ranker.config import RankerConfig
from tooling.local.workload import WorkloadSpec
from tooling.sim.fleet import FleetSettings
from tooling.sim.membership import FleetEvent
from tooling.sim.profile import load_profile
from tooling.sim.ranker import MODEL_VERSION
from tooling.sim.sweep import SweepSpec, run_point
from tooling.sim.workload import light_visits


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--profile", type=Path, default=ROOT / "profiles" / "nvidia-h100.toml")
    p.add_argument("--fleet", type=int, default=1000, help="rankers in the fleet sized")
    p.add_argument("--users", type=int, default=100_000_000, help="the fleet's population")
    p.add_argument("--per-ranker", type=float, default=20.0, help="req/s per ranker")
    p.add_argument("--slice", type=int, default=20, help="rankers simulated")
    p.add_argument("--check-fleet", type=int, default=40, help="fleet run in full for the check")
    p.add_argument("--check-slice", type=int, default=10)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--event-at", type=float, default=20.0, help="when each change starts, s")
    p.add_argument("--variant", default="relay all")
    p.add_argument("--slo-ms", type=float, default=20.0)
    p.add_argument("--margin-ms", type=float, default=10.0)
    p.add_argument("--gap-ms", type=float, default=100.0)
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument(
        "--triggers", type=int, default=0, help="trigger replicas (0: one per 10 rankers)"
    )
    add_run_arguments(p, quick="smoke run: short, small")
    args = parse_run(p, argv)
    if args.quick:
        args.duration, args.slice, args.check_fleet, args.check_slice = 20.0, 5, 10, 5
        args.event_at = 8.0
    return args


NO_HANDOFF = "rolling restart, no hand-off"
SHORT_HANDOFF = "rolling restart, 1 s hand-off budget"


def spec_for(args: argparse.Namespace, rankers: int, share: float) -> tuple[SweepSpec, float]:
    """A spec for `rankers` simulated rankers standing for a fleet of rankers/share."""
    profile = load_profile(args.profile)
    triggers = args.triggers or max(1, rankers // 10)
    workload = WorkloadSpec(
        users=max(1, int(args.users * share)), candidates=args.candidates, gap_s=args.gap_ms / 1e3
    )
    fleet = FleetSettings.serving(rankers, args.slo_ms, args.margin_ms, args.gap_ms, triggers)
    spec = SweepSpec(profile, fleet, workload, (), args.duration, (args.seed,), bin_s=2.0)
    return spec, args.per_ranker * rankers


def scenario(
    spec: SweepSpec, rate: float, seed: int, events: tuple[str, ...], variant: str
) -> dict:
    run = replace(spec, events=tuple(FleetEvent.parse(e) for e in events))
    visits = light_visits(spec.workload, rate, spec.duration_s, seed)
    done = run_point(run, variant, rate, seed, visits, spec.duration_s)
    return {**done.summary(spec.slo_ms), "events": list(events)}


def entry_bytes(entries: int = 100_000) -> float:
    """Python heap per directory entry as a router holds it: entries fed to the etcd-backed
    directory as its watch delivers them (the event's key and value are freed after, as the
    watch's are), so the key, the parsed record and the entry are counted."""
    directory = EtcdMembershipDirectory(EtcdClient(["127.0.0.1:2379"]))  # never connected
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(entries):
        placement = PlacementRecord(f"user-{i:09d}", "ranker-0", 10.0, MODEL_VERSION)
        key = directory._directory_key((MODEL_VERSION, placement.user_id))
        value = entry_value(placement, "ranker-0")
        directory._on_directory_event(WatchEvent(EventKind.PUT, key, value, i + 1))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / entries


def run(args: argparse.Namespace) -> dict:
    started = machine_info()  # the commit this run measures, stamped before it runs
    k, n = args.slice, args.fleet
    spec, rate = spec_for(args, k, k / n)
    t0 = args.event_at
    rolling = (f"{t0:g}:rolling-restart:{(args.duration - t0) * 0.6 / k:g}",)

    def ranker_with(ranker: RankerConfig) -> SweepSpec:
        return replace(spec, fleet=replace(spec.fleet, ranker=ranker))

    base = spec.fleet.ranker
    scenarios = {
        "steady": ((), spec),
        "kill one ranker": ((f"{t0:g}:kill:ranker-0",), spec),
        "rolling restart": (rolling, spec),
        SHORT_HANDOFF: (rolling, ranker_with(replace(base, handoff_budget_s=1.0))),
        NO_HANDOFF: (rolling, ranker_with(replace(base, handoff=False))),
        "scale-out 10%": ((f"{t0:g}:scale-out:{max(1, k // 10)}",), spec),
    }
    results: dict = {"scenarios": {}, "check": {}}
    for name, (events, run_spec) in scenarios.items():
        row = scenario(run_spec, rate, args.seed, events, args.variant)
        results["scenarios"][name] = row
        print(
            f"{name:>16}: p99 {row['p99_ms']:.1f} ms hits {row['hit_ratio']:.0%} "
            f"dir writes {row['fleet']['directory_writes']} ({row['wall_s']:.0f} s)",
            flush=True,
        )
    results["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    big, share = args.check_fleet, args.check_fleet / n
    full_spec, full_rate = spec_for(args, big, share)
    small_spec, small_rate = spec_for(args, args.check_slice, share * args.check_slice / big)
    results["check"] = {
        "full": scenario(full_spec, full_rate, args.seed, (), args.variant),
        "slice": scenario(small_spec, small_rate, args.seed, (), args.variant),
    }
    results["entry_bytes"] = entry_bytes()
    return save_results("sim_sizing", args, results, started, threads=1)


def per_s(count: float, seconds: float) -> float:
    return count / seconds if seconds else 0.0


def render(saved: dict) -> str:
    a = saved["args"]
    n, k, duration = a["fleet"], a["slice"], a["duration"]
    scale = n / k
    steady = saved["scenarios"]["steady"]
    f = steady["fleet"]
    dir_writes = per_s(f["directory_writes"], duration) * scale
    entries = f["peak_directory_entries"] * scale
    keepalives = n * 3 / 5.0  # the lease TTL's default 5 s, renewed about three times a TTL
    peak = f.get("peak_memory_per_ranker", {})
    lines = [
        f"## Sizing: simulated fleet of {n:,} rankers, {a['users']:,} users",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. Simulated: profile `{Path(a['profile']).stem}`, "
        f"{a['per_ranker']:g} req/s per ranker ({a['per_ranker'] * n:,.0f} req/s over the fleet), "
        f"variant `{a['variant']}`, SLO {a['slo_ms']:g} ms, gap {a['gap_ms']:g} ms; a slice of "
        f"{k} rankers at {a['per_ranker'] * k:g} req/s over {a['users'] * k / n:,.0f} users stands "
        f"for the fleet ({duration:g} s, seed {a['seed']}: {seeds_note(1)}); peak process memory "
        f"{saved['max_rss_mib']:,.0f} MiB.",
        "",
        "| scenario | P50 ms | P99 ms | hits | relayed | failed | directory writes / s (fleet) "
        "| registrations | deregistrations |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in saved["scenarios"].items():
        fl = row["fleet"]
        lines.append(
            f"| {name} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['hit_ratio']:.0%} "
            f"| {row['relayed_ratio']:.0%} | {row['sent'] - row['ok']:,} "
            f"| {per_s(fl['directory_writes'], duration) * scale:,.0f} "
            f"| {fl['registrations']} | {fl['deregistrations']} |"
        )
    lines += [
        "",
        "**Hit rate through each change** (share of Ranks served from a cache, per 2 s "
        "of send time; "
        f"the change starts at {a['event_at']:g} s):",
        "",
        "| scenario | before | lowest during | end |",
        "|---|---:|---:|---:|",
    ]
    for name, row in saved["scenarios"].items():
        bins = [b for b in row["timeline"] if b["ranks"]]
        before = [b["hit_ratio"] for b in bins if b["t"] + 2 <= a["event_at"] and b["t"] >= 4]
        after = [b["hit_ratio"] for b in bins if b["t"] >= a["event_at"] and b["t"] < duration]
        mean_before = sum(before) / len(before) if before else 0.0
        lines.append(
            f"| {name} | {mean_before:.0%} | {min(after, default=0):.0%} "
            f"| {after[-1] if after else 0:.0%} |"
        )
    lines += handoff_cost(saved["scenarios"], duration, scale)
    check = saved["check"]
    full, part = check["full"], check["slice"]
    lines += [
        "",
        "**Steady state, the fleet's totals:**",
        "",
        f"- etcd writes: directory {dir_writes:,.0f}/s (a placement is written only when a relay "
        f"lands off its user's hash owner, at most twice a relay window), membership ~0/s; lease "
        f"keepalives ~{keepalives:,.0f}/s (each ranker renews about three times per 5 s TTL).",
        f"- Directory entries live: ~{entries:,.0f}; at {saved['entry_bytes']:.0f} bytes of "
        f"router heap each (measured), {entries * saved['entry_bytes'] / 2**20:,.1f} MiB per "
        "router; each router's watch delivers every directory write and membership change: "
        f"~{dir_writes:,.0f} events/s.",
    ]
    if peak:
        lines.append(
            f"- Device memory per ranker at {a['per_ranker']:g} req/s: peak "
            f"{peak.get('device_used', 0) / 2**30:,.2f} GiB used, "
            f"{peak.get('device_pinned', 0) / 2**30:,.2f} GiB pinned by relays awaiting their "
            f"Rank; host tier peak {peak.get('host_used', 0) / 2**30:,.2f} GiB."
        )
    lines += [
        "",
        f"**What the slice costs** (a fleet of {a['check_fleet']} rankers in full vs a slice of "
        f"{a['check_slice']} at the same load per ranker and population per ranker):",
        "",
        "| run | P50 ms | P99 ms | hits | relayed | directory writes / ranker-s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row, rankers in (("full", full, a["check_fleet"]), ("slice", part, a["check_slice"])):
        writes = per_s(row["fleet"]["directory_writes"], duration) / rankers
        lines.append(
            f"| {name} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['hit_ratio']:.1%} "
            f"| {row['relayed_ratio']:.1%} | {writes:.3f} |"
        )
    return "\n".join(lines) + "\n"


def handoff_cost(scenarios: dict, duration: float, scale: float) -> list[str]:
    """Why a rolling restart writes the directory more with hand-off on than off."""
    if NO_HANDOFF not in scenarios:
        return []  # a run from before the comparison was measured
    on, off = scenarios["rolling restart"]["fleet"], scenarios[NO_HANDOFF]["fleet"]

    def writes(fleet: dict) -> str:
        return f"{per_s(fleet['directory_writes'], duration) * scale:,.0f}/s"

    def drain_s(fleet: dict) -> float:  # a drain's registered time, on average
        return fleet["draining_s"] / max(1, fleet["deregistrations"])

    def misses(name: str) -> int:
        return scenarios[name]["outcomes"].get("miss", 0)

    lines = [
        "",
        f"**What the hand-off costs the directory in a rolling restart:** {writes(on)} of "
        f"directory writes with hand-off, {writes(off)} without "
        f"(`handoff = false`). A draining ranker stays registered while it hands off "
        f"({drain_s(on):.1f} s a drain on average, against {drain_s(off):.2f} s without), "
        "refusing new "
        "relays; the router spills each to the user's next owner, which is off the hash owner "
        "while the draining ranker is listed, so each is written to the directory (placed "
        f"off the hash owner: {on['placed'].get('spilled', 0):,} against "
        f"{off['placed'].get('spilled', 0):,}; peak directory entries "
        f"{on['peak_directory_entries']:,} against {off['peak_directory_entries']:,} in the "
        f"slice). What it carried: {on['handed_off']:,} prefixes handed off over "
        f"{on['deregistrations']} drains; misses {misses('rolling restart'):,} against "
        f"{misses(NO_HANDOFF):,} without.",
    ]
    if SHORT_HANDOFF in scenarios:
        short = scenarios[SHORT_HANDOFF]["fleet"]
        lines[-1] += (
            f" With a 1 s budget (`handoff_budget_s = 1`): {writes(short)} of writes, "
            f"{drain_s(short):.1f} s a drain, "
            f"{short['handed_off']:,} prefixes handed off, {misses(SHORT_HANDOFF):,} misses."
        )
    return lines


def main() -> int:
    args = parse()
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", "sim_sizing")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
