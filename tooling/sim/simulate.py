"""`relaygr simulate`: the relay benchmark's variants on a virtual clock, with a device profile.

    relaygr simulate --profile profiles/nvidia-h100.toml --rankers 8 --rates 500 1000 2000
    relaygr simulate --profile cpu.toml --trace visits.jsonl --rankers 2
    relaygr simulate --profile-from 127.0.0.1:50061 --write-profile cpu.toml ...

Writes results.json, results.md and p99.png (with matplotlib) under --out, and prints the
Markdown. The simulator runs the services' own admission policy, placement, router books, KV
store, scheduler order and cost model; see docs/simulator.md for what it does not model.
"""

import argparse
import random
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from relaygr.bounds import AT_LEAST_ONE, POSITIVE, SHARE, Bound, Bounded
from relaygr.cli_help import HelpFormatter
from relaygr.config import default_of
from relaygr.errors import ConfigError, InvalidInput
from services.ranker.config import RankerConfig
from services.router.config import RouterConfig
from services.trigger.config import TriggerConfig
from tooling.local.workload import WorkloadSpec, read_trace
from tooling.sim import output
from tooling.sim.fleet import FleetSettings
from tooling.sim.membership import FleetEvent
from tooling.sim.processes import add_jobs_arg, jobs_for
from tooling.sim.profile import DeviceProfile, load_profile, write_profile
from tooling.sim.progress import Progress
from tooling.sim.sweep import VARIANTS, SweepSpec, run_sweep
from tooling.sim.workload import Visit, visits_of

DEFAULTS = WorkloadSpec()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relaygr simulate", description=__doc__, formatter_class=HelpFormatter
    )
    add_device_args(p)
    work = add_workload_args(p)
    work.add_argument(
        "--rates", type=Bounded(float, POSITIVE), nargs="+", default=[1.0], help="req/s"
    )
    work.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="workload and fleet seeds (default: one drawn at random, printed)",
    )
    fleet = add_fleet_args(p)
    fleet.add_argument("--rankers", type=Bounded(int, AT_LEAST_ONE), default=2, help="fleet size")
    fleet.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="V",
        help=f"of: {', '.join(VARIANTS)}",
    )  # fmt: skip
    fleet.add_argument(
        "--slo-ms", type=Bounded(float, POSITIVE), default=50.0, help="P99 ranking SLO, ms"
    )
    fleet.add_argument(
        "--event",
        dest="events",
        action="append",
        default=[],
        metavar="T:KIND[:ARG]",
        help="fleet change: T:kill:RANKER, T:drain:RANKER, T:start, T:scale-out:N, "
        "T:rolling-restart:SECONDS (repeatable; rankers are ranker-0, ranker-1, ...)",
    )
    add_jobs_arg(fleet, "points (variant, rate, seed)")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("relaygr-sim"), help="results directory")
    out.add_argument(
        "--bin-s", type=Bounded(float, POSITIVE), default=5.0, help="timeline resolution"
    )
    return p


def add_device_args(p: argparse.ArgumentParser) -> None:
    """The device profile's options (`profile_of` reads them); shared with `relaygr plan`."""
    src = p.add_argument_group("device")
    src.add_argument(
        "--profile",
        type=Path,
        help="device profile, TOML (see profiles/); this or --profile-from (no default)",
    )
    src.add_argument(
        "--profile-from",
        metavar="HOST:PORT",
        help="read a measured profile from a live ranker's Describe instead (plaintext; "
        "default: none)",
    )
    src.add_argument(
        "--write-profile",
        type=Path,
        help="also write the profile used to this file (default: none)",
    )
    src.add_argument(
        "--utilisation",
        type=Bounded(float, SHARE),
        help="the device's achieved share of peak compute; rescales the profile's compute"
        " terms from the utilisation it states (default: the profile's)",
    )
    src.add_argument(
        "--device-tier-mib",
        type=Bounded(float, POSITIVE),
        help="override the profile's device (HBM) tier per ranker, MiB (default: the profile's)",
    )


def add_workload_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The workload's options (`workload_of`, `trace_of` read them), rates and seeds apart."""
    work = p.add_argument_group("workload")
    work.add_argument(
        "--trace",
        type=Path,
        help="replay this trace file, docs/trace-format.md (default: none, visits are drawn)",
    )
    work.add_argument(
        "--duration", type=Bounded(float, POSITIVE), default=60.0, help="seconds per point"
    )
    work.add_argument(
        "--users", type=Bounded(int, AT_LEAST_ONE), default=1_000_000, help="the population"
    )
    work.add_argument(
        "--median-long-term",
        type=Bounded(int, AT_LEAST_ONE),
        default=DEFAULTS.median_long_term,
        help="median long-term behaviours",
    )
    work.add_argument(
        "--long-term-sigma", type=Bounded(float, Bound(low=0)), default=1.0, help="log-normal"
    )
    work.add_argument(
        "--max-long-term", type=Bounded(int, AT_LEAST_ONE), default=8192, help="length cap"
    )
    work.add_argument("--candidates", type=Bounded(int, AT_LEAST_ONE), default=128, help="per Rank")
    work.add_argument(
        "--gap-sigma", type=Bounded(float, Bound(low=0)), default=0.0,
        help="log-normal spread of each retrieval's gap around --gap-ms (0: fixed; assumption)",
    )  # fmt: skip
    work.add_argument(
        "--no-show", type=Bounded(float, Bound(low=0, high=1, high_open=True)), default=0.0,
        help="share of retrievals never followed by a Rank (filtered, abandoned; assumption)",
    )  # fmt: skip
    work.add_argument(
        "--warmup", type=Bounded(float, Bound(low=0, high=1, high_open=True)), default=0.2,
        help="share of each point not counted",
    )  # fmt: skip
    return work


def add_fleet_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The services' options (`fleet_of` reads them), fleet size and SLO apart."""
    fleet = p.add_argument_group("fleet")
    fleet.add_argument(
        "--margin-ms", type=Bounded(float, Bound(low=0)),
        default=default_of(TriggerConfig, "margin_ms"), help="at-risk margin",
    )  # fmt: skip
    fleet.add_argument(
        "--gap-ms", type=Bounded(float, POSITIVE),
        default=default_of(TriggerConfig, "expected_gap_ms"), help="retrieval to Rank",
    )  # fmt: skip
    fleet.add_argument(
        "--relay-window-ms", type=Bounded(int, AT_LEAST_ONE),
        default=default_of(TriggerConfig, "relay_window_ms"), help="relay pin",
    )  # fmt: skip
    fleet.add_argument(
        "--relay-budget-share", type=Bounded(float, SHARE),
        default=default_of(TriggerConfig, "relay_budget_share"),
        help="share of each ranker's relay budget the trigger fills",
    )  # fmt: skip
    fleet.add_argument(
        "--chunk-tokens", type=Bounded(int, AT_LEAST_ONE),
        default=default_of(RankerConfig, "prefill_chunk_tokens"),
        help="background prefill chunk (the least: see --chunk-fixed-share)",
    )  # fmt: skip
    fleet.add_argument(
        "--chunk-fixed-share", type=Bounded(float, SHARE),
        default=default_of(RankerConfig, "prefill_chunk_fixed_share"),
        help="most share of a background chunk's time its call's fixed cost may take: the chunk"
        " grows from --chunk-tokens until it does (1: never grows)",
    )  # fmt: skip
    fleet.add_argument(
        "--handoff", action=argparse.BooleanOptionalAction, default=True,
        help="a draining ranker hands its prefixes to their next owners (the ranker's handoff)",
    )  # fmt: skip
    fleet.add_argument(
        "--peer-fetch", action=argparse.BooleanOptionalAction, default=True,
        help="a ranker that misses after a move fetches the prefix from a peer (peer_fetch)",
    )  # fmt: skip
    return fleet


def workload_of(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        users=args.users,
        median_long_term=args.median_long_term,
        long_term_sigma=args.long_term_sigma,
        max_long_term=args.max_long_term,
        min_long_term=min(DEFAULTS.min_long_term, args.max_long_term),
        candidates=args.candidates,
        gap_s=args.gap_ms / 1e3,
        gap_sigma=args.gap_sigma,
        no_show_p=args.no_show,
    )


def fleet_of(args: argparse.Namespace, rankers: int) -> FleetSettings:
    """The services' configurations; ConfigError when they do not hold together (a margin not
    below the SLO, say)."""
    return FleetSettings(
        rankers=rankers,
        ranker=RankerConfig(
            plaintext=True,
            prefill_chunk_tokens=args.chunk_tokens,
            prefill_chunk_fixed_share=args.chunk_fixed_share,
            handoff=args.handoff,
            peer_fetch=args.peer_fetch,
        ),
        router=RouterConfig(plaintext=True),
        trigger=TriggerConfig(
            plaintext=True,
            slo_ms=args.slo_ms,
            margin_ms=args.margin_ms,
            expected_gap_ms=args.gap_ms,
            relay_budget_share=args.relay_budget_share,
        ),
        gap_s=args.gap_ms / 1e3,
    ).with_relay_window(args.relay_window_ms)


def trace_of(args: argparse.Namespace) -> tuple[Visit, ...] | None:
    return None if args.trace is None else tuple(visits_of(read_trace(args.trace)))


def spec_from(args: argparse.Namespace, profile: DeviceProfile) -> SweepSpec:
    return SweepSpec(
        profile=profile,
        fleet=fleet_of(args, args.rankers),
        workload=workload_of(args),
        rates=tuple(args.rates),
        duration_s=args.duration,
        seeds=tuple(args.seeds),
        variants=tuple(args.variants),
        warmup=args.warmup,
        trace=trace_of(args),
        events=tuple(FleetEvent.parse(e) for e in args.events),
        bin_s=args.bin_s,
    )


def profile_of(args: argparse.Namespace) -> DeviceProfile:
    if (args.profile is None) == (args.profile_from is None):
        raise InvalidInput("give one of --profile FILE or --profile-from HOST:PORT")
    if args.profile is not None:
        profile = load_profile(args.profile)
    else:
        from tooling.sim.measured import read_profile  # grpc only when asked

        profile = read_profile(args.profile_from)
    if args.utilisation is not None:
        profile = profile.at_utilisation(args.utilisation)
    if args.device_tier_mib is not None:
        profile = profile.with_memory(int(args.device_tier_mib * 2**20))
    if args.write_profile is not None:
        write_profile(profile, args.write_profile)
    return profile


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.seeds is None:
        args.seeds = [random.SystemRandom().randrange(2**32)]
        print(f"seed {args.seeds[0]}", flush=True)
    try:
        spec = spec_from(args, profile_of(args))
    except (InvalidInput, ConfigError, OSError) as err:
        print(f"relaygr simulate: error: {err}", file=sys.stderr)
        return 2
    rates = 1 if spec.trace is not None else len(spec.rates)
    points = len(spec.seeds) * rates * len(spec.variants)
    bar = Progress(points, "simulating")
    jobs = jobs_for(args.jobs, points)
    result = run_sweep(spec, lambda p: bar.step(f"{p.variant} {p.point.rate:g}/s"), jobs)
    command = shlex.join(["relaygr", "simulate", *with_seeds(argv, spec.seeds)])
    data = output.to_json(result, command)
    written = output.write(data, args.out)
    print(output.markdown(data))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def with_seeds(argv: list[str], seeds: Sequence[int]) -> list[str]:
    """The command line as run: the seeds drawn are spelled out."""
    if "--seeds" in argv:
        return argv
    return [*argv, "--seeds", *map(str, seeds)]


if __name__ == "__main__":
    sys.exit(main())
