"""`relaygr plan`: how many rankers, and how much device and host memory each, meet a P99 SLO at a
target rate, found by simulating the fleet (`tooling.sim.plan` searches; this module wires the
simulator in, and prints the answer with its assumptions).

    relaygr plan --profile profiles/nvidia-h200.toml --qps 320 --slo-ms 20 --gap-ms 100 \
        --candidates 256 --duration 30 --check-slice
    relaygr plan --profile profiles/ascend-910b.toml --qps 100 --slo-ms 50 --median-long-term 1000
    relaygr plan --profile cpu.toml --trace visits.jsonl --qps 5 --slo-ms 1500 --json plan.json

The fleet runs the `relay sequence-aware` variant unless --variant says otherwise. N rankers
are simulated as a slice of at most --slice of them at that share of the rate and of the users.
"""

import argparse
import json
import random
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from relaygr.bounds import AT_LEAST_ONE, POSITIVE, Bounded
from relaygr.cli_help import HelpFormatter
from relaygr.errors import ConfigError, InvalidInput
from tooling.sim.plan import Goal, Plan, Run, Slice, confirm, default_step, search, slice_trace
from tooling.sim.plan_report import Ask, SliceCheck, report, size, to_json
from tooling.sim.processes import Processes, add_jobs_arg, jobs_for
from tooling.sim.profile import MIB
from tooling.sim.simulate import (
    add_device_args,
    add_fleet_args,
    add_workload_args,
    fleet_of,
    profile_of,
    trace_of,
    with_seeds,
    workload_of,
)
from tooling.sim.sweep import VARIANTS, PointResult, SweepSpec, run_point
from tooling.sim.workload import Visit, light_visits

VARIANT = "relay sequence-aware"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relaygr plan", description=__doc__, formatter_class=HelpFormatter
    )
    add_device_args(p)
    work = add_workload_args(p)
    work.add_argument(
        "--qps",
        type=Bounded(float, POSITIVE),
        required=True,
        help="target Rank rate, req/s (required, no default)",
    )
    work.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="a size passes only if every seed does (default: two drawn at random, printed)",
    )
    fleet = add_fleet_args(p)
    fleet.add_argument(
        "--slo-ms",
        type=Bounded(float, POSITIVE),
        required=True,
        help="P99 ranking SLO, ms (required, no default)",
    )
    fleet.add_argument("--variant", choices=list(VARIANTS), default=VARIANT, metavar="V",
                       help=f"of: {', '.join(VARIANTS)}")  # fmt: skip
    find = p.add_argument_group("search")
    find.add_argument(
        "--slice",
        type=Bounded(int, AT_LEAST_ONE),
        default=8,
        help="most rankers simulated; a larger fleet is simulated as this many at their "
        "share of the rate and of the users",
    )
    find.add_argument(
        "--min-ranks",
        type=Bounded(int, AT_LEAST_ONE),
        default=2000,
        help="each run lasts long enough to count this many Ranks, beyond --duration if need "
        "be (a P99 of fewer means little; a trace is replayed as it is)",
    )
    find.add_argument(
        "--rankers-per-trigger",
        type=Bounded(int, AT_LEAST_ONE),
        default=1,
        help="trigger replicas: one per this many rankers, at least one (each dispatches "
        "up to its dispatch_concurrency PreInfers at once)",
    )
    find.add_argument(
        "--max-rankers", type=Bounded(int, AT_LEAST_ONE), default=4096, help="give up above"
    )
    find.add_argument(
        "--memory-step-mib",
        type=Bounded(float, POSITIVE),
        help="grid of the device tier search (default: the largest power of two of bytes at "
        "most 1/32 of the profile's tier)",
    )
    find.add_argument(
        "--check-slice",
        action="store_true",
        help="also simulate the whole fleet at the answer (when larger than the slice), print "
        "how far the slice was from it and, where the whole fleet misses the SLO, search "
        "again from the slice's answer with every fleet simulated whole",
    )
    add_jobs_arg(find, "simulations (a step's seeds, at most one process per seed)")
    out = p.add_argument_group("output")
    out.add_argument(
        "--json",
        type=Path,
        help="also write the plan as a result file to this path: the command, the machine and "
        "the commit stamped as the run starts, the answer, every step, the slice check and the "
        "printed report (bench/plan_bench.py stores one in bench/results/; default: none)",
    )
    return p


@dataclass(slots=True)
class Simulator:
    """`plan.Evaluate` by the simulator: N rankers as a `Slice` of at most `most` of them, on
    the workload drawn for that slice (or the trace's share of it), on a fresh fleet each run."""

    spec: SweepSpec  # the profile's tier and the services' configurations; rankers unset
    variant: str
    qps: float
    most: int
    min_ranks: int
    rankers_per_trigger: int
    _visits: dict[tuple[Slice, int], tuple[list[Visit], float]] = field(default_factory=dict)

    def __call__(self, rankers: int, device_tier_bytes: int, seed: int) -> Run:
        part = Slice.of(rankers, self.most)
        visits, span = self.visits(part, seed)
        spec = replace(
            self.spec,
            profile=self.spec.profile.with_memory(device_tier_bytes),
            fleet=replace(
                self.spec.fleet,
                rankers=part.rankers,
                triggers=-(-part.rankers // self.rankers_per_trigger),
            ),
        )
        done = run_point(spec, self.variant, part.rate(self.qps), seed, visits, span)
        return run_of(done, span)

    def visits(self, part: Slice, seed: int) -> tuple[list[Visit], float]:
        """The slice's visits and span; those of one slice are kept while it is searched."""
        kept = self._visits.get((part, seed))
        if kept is not None:
            return kept
        if any(key[0] != part for key in self._visits):
            self._visits.clear()
        spec = self.spec
        if spec.trace is not None:
            visits = slice_trace(spec.trace, self.qps, part)
            span = visits[-1].at if visits else 0.0
        else:
            workload = replace(spec.workload, users=part.users(spec.workload.users))
            rate = part.rate(self.qps)
            span = max(spec.duration_s, self.min_ranks / (rate * (1 - spec.warmup)))
            visits = light_visits(workload, rate, span, seed)
        self._visits[(part, seed)] = (visits, span)
        return visits, span


def run_of(result: PointResult, span_s: float) -> Run:
    p = result.point
    return Run(
        result.seed,
        p.sent,
        p.sent - p.ok,
        p.p50_ms,
        p.p99_ms,
        p.hit_ratio,
        p.relayed_ratio,
        result.peak,
        span_s,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    started: dict[str, object] | None = None
    if args.json is not None:  # the commit this run measures, stamped before it runs
        from tooling.local.run_stamp import machine_info  # torch: only when a file is written

        started = machine_info(threads=1)
    if args.seeds is None:
        drawn = random.SystemRandom()
        args.seeds = [drawn.randrange(2**32) for _ in range(2)]
        print(f"seeds {' '.join(map(str, args.seeds))}", flush=True)
    try:
        profile = profile_of(args)
        spec = SweepSpec(
            profile=profile,
            fleet=fleet_of(args, 1),
            workload=workload_of(args),
            rates=(args.qps,),
            duration_s=args.duration,
            seeds=tuple(args.seeds),
            variants=(args.variant,),
            warmup=args.warmup,
            trace=trace_of(args),
        )
    except (InvalidInput, ConfigError, OSError) as err:
        print(f"relaygr plan: error: {err}", file=sys.stderr)
        return 2
    if spec.trace is not None and len(spec.trace) < 2:
        print(f"relaygr plan: error: {args.trace}: needs at least two visits", file=sys.stderr)
        return 2
    step = (
        default_step(profile.device_tier_bytes)
        if args.memory_step_mib is None
        else max(1, int(args.memory_step_mib * MIB))
    )
    goal = Goal(args.slo_ms, tuple(args.seeds), profile.device_tier_bytes, step, args.max_rankers)
    simulate = Simulator(
        spec, args.variant, args.qps, args.slice, args.min_ranks, args.rankers_per_trigger
    )

    def heard(rankers: int, tier: int, run: Run) -> None:
        verdict = "meets" if run.meets(args.slo_ms) else "misses"
        print(
            f"  {rankers} rankers, {size(tier)} device tier, seed {run.seed}: P99 "
            f"{run.p99_ms:.1f} ms, {run.failed} failed: {verdict} the SLO",
            file=sys.stderr,
            flush=True,
        )

    jobs = jobs_for(args.jobs, len(args.seeds))
    with Processes(simulate, jobs) as runs:
        plan = search(simulate, goal, heard, runs=runs)
    check: list[SliceCheck] = []
    sliced: Plan | None = None  # the slice's plan, where the whole fleet's replaced it
    answer = plan.answer
    if args.check_slice and answer is not None and answer.rankers > args.slice:
        whole = replace(simulate, most=args.max_rankers, _visits={})
        with Processes(whole, jobs) as runs:
            asks = [(answer.rankers, answer.device_tier_bytes, run.seed) for run in answer.runs]
            check = [SliceCheck(*pair) for pair in zip(answer.runs, runs(asks), strict=True)]
            replanned = confirm(plan, [c.whole for c in check], whole, heard, runs)
        if replanned is not None:
            sliced, plan = plan, replanned
    ask = Ask(
        shlex.join(["relaygr", "plan", *with_seeds(argv, args.seeds)]),
        args.qps,
        args.slo_ms,
        args.variant,
        args.slice,
        args.max_rankers,
        args.min_ranks,
        args.rankers_per_trigger,
        str(args.profile or args.profile_from),
        None if args.trace is None else str(args.trace),
        spec,
    )
    text = report(plan, ask, check, sliced)
    print(text, end="")
    if args.json is not None:
        saved = {
            **to_json(plan, ask, check, sliced),
            "machine": started,
            "jobs": jobs,  # simulations at once: the answer's the same, the wall time not
            "report": text,
        }
        args.json.write_text(json.dumps(saved, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if plan.answer is not None else 1


if __name__ == "__main__":
    sys.exit(main())
