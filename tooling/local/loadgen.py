"""`relaygr loadgen`: the highest QPS each system serves within gap + SLO at P99, by MLPerf LoadGen.

For each system (no cache, cache only, relay all, relay sequence-aware: tooling.local.modes) it
runs LoadGen's Server scenario (tooling.local.loadgen_sut) at target QPS on a grid of
`--qps-step`: doubling from `--qps-from` until a test is not valid (halving down to `--qps-min`
when the first one is not), then bisecting, never above `--qps-max`. A test is
valid when LoadGen says VALID (P99 of gap + ranking latency within gap + SLO, minimum duration
and queries, its early-stopping check) and no Rank failed. Each test has its own users (same
seed, own user ids), so no test warms another's cache.

Against a local mesh it starts (etcd, rankers, router, trigger on loopback: one mesh for the
three systems that differ only in the trigger's mode, another whose rankers bypass every cache)
or against a running one (`--router`, `--trigger`; `--etcd` to switch the trigger's mode).
LoadGen's logs stay in `--out`, one folder per test; the result file (JSON: command, commit at
the start with a dirty tree flagged, machine, settings, every test) is what
`relaygr bench loadgen` renders into docs/benchmarks.md.

    relaygr loadgen --smoke          # one test, tiny model, under a minute: LoadGen's verdict
    relaygr loadgen                  # the search, four systems (minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import secrets
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from relaygr.behaviours import RankInput
from relaygr.bounds import AT_LEAST_ONE, POSITIVE, Bounded
from relaygr.cli_help import HelpFormatter
from services.ranker.model_config import PRESETS, ModelPreset
from tooling.local.drive import Point, set_trigger_mode
from tooling.local.loadgen_sut import (
    PERCENTILE,
    PERCENTILES,
    ServerTest,
    Target,
    Verdict,
    run_server_test,
)
from tooling.local.mesh import ROUTER_REPLICAS, LocalMesh, MeshSpec
from tooling.local.modes import BY_LABEL, RELAY_AWARE, SYSTEMS, System
from tooling.local.run_stamp import machine_info
from tooling.local.search import grid_search
from tooling.local.workload import Population, WorkloadSpec, poisson_arrivals

RESULT_FILE = "loadgen.json"


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a search reads, from the command line."""

    model: ModelPreset
    rankers: int
    users: int
    median_long_term: int
    max_long_term: int
    gap_ms: float
    slo_ms: float
    margin_ms: float
    qps_from: float
    qps_min: float
    qps_max: float
    qps_step: float
    min_duration_s: float
    min_queries: int
    timeout_s: float
    seed: int
    percentile: float = PERCENTILE

    def workload(self) -> WorkloadSpec:
        return WorkloadSpec(
            users=self.users,
            median_long_term=self.median_long_term,
            long_term_sigma=0.8,
            max_long_term=self.max_long_term,
            candidates=PRESETS[self.model].max_candidates,
            gap_s=self.gap_ms / 1e3,
        )

    def test(self, qps: float) -> ServerTest:
        return ServerTest(
            qps, self.gap_ms, self.slo_ms, self.min_duration_s, self.min_queries,
            self.timeout_s, self.seed, self.percentile,
        )  # fmt: skip


def visits(settings: Settings, system: System, qps: float) -> list[RankInput]:
    """The requests of a test at `qps`, in visit order: the seed's population, user ids of the
    system's and the QPS's own (no test warms another's cache)."""
    needed = settings.test(qps).visits_needed()
    slug = system.label.replace(" ", "-")
    spec = replace(settings.workload(), user_prefix=f"{slug}-q{qps:g}-s{settings.seed}")
    duration = needed / qps * 1.2 + 5.0 / qps
    while True:
        population = Population(spec, np.random.default_rng(settings.seed))
        arrivals = poisson_arrivals(population, qps, duration)
        if len(arrivals) >= needed:
            return [a.request for a in arrivals[:needed]]
        duration *= 1.5


def check_mode(system: System, point: Point) -> None:
    """Refuse a test whose rankers were not in the system's mode (a running mesh is trusted to
    be): a `no cache` run sees only bypass outcomes, the others none."""
    bypassed = point.outcomes.get("bypass", 0)
    if point.ok and (bypassed != point.ok if system.bypass else bypassed):
        want = "bypass every cache" if system.bypass else "keep caches"
        raise SystemExit(
            f"the mesh is not in mode {system.label!r}: its rankers should {want}, yet their "
            f"outcomes were {point.outcomes} (start them with{'' if system.bypass else 'out'} "
            "--no-relay-enabled)"
        )


def is_valid(verdict: Verdict, point: Point) -> bool:
    """LoadGen says VALID and no Rank failed (LoadGen counts a failed query as answered)."""
    return verdict.valid and not point.errors


def search(
    system: System, target: Target, settings: Settings, out: Path, smoke: bool
) -> dict[str, Any]:
    """The system's tests (one at --qps-from when `smoke`) and its highest valid QPS."""
    runs: list[dict[str, Any]] = []
    slug = system.label.replace(" ", "-")

    def passes(steps: int) -> bool:
        qps = steps * settings.qps_step
        logs = out / slug / f"qps-{qps:g}"
        print(f"{system.label}: LoadGen Server scenario at {qps:g} QPS ...", flush=True)
        ran = run_server_test(
            target, visits(settings, system, qps), settings.test(qps), f"{slug}-{qps:g}", logs
        )
        point = Point.of(system.label, qps, ran.arrivals, ran.records, warmup_s=0.0)
        check_mode(system, point)
        valid = is_valid(ran.verdict, point)
        print(f"  {ran.verdict.text()}", flush=True)
        if point.errors:
            print(f"  failed Ranks: {point.errors}: not valid", flush=True)
        print(
            f"  Ranks answered {point.ok}, relayed {point.relayed_ratio:.0%}, cross-visit "
            f"{point.cached_ratio:.0%}; logs: {logs}",
            flush=True,
        )
        runs.append({
            "qps": qps,
            "valid": valid,
            "loadgen": dataclasses.asdict(ran.verdict),
            "pipeline": point.summary(),
            "logs": str(logs),
            "summary": (logs / "mlperf_log_summary.txt").read_text(errors="replace"),
        })  # fmt: skip
        return valid

    lo = max(1, round(settings.qps_from / settings.qps_step))
    hi = lo if smoke else max(lo, round(settings.qps_max / settings.qps_step))
    floor = lo if smoke else min(lo, max(1, round(settings.qps_min / settings.qps_step)))
    best, _ = grid_search(lo, hi, 1, passes, floor=floor)
    return {"highest_valid_qps": best * settings.qps_step, "runs": runs}


@contextmanager
def local_target(settings: Settings, system: System) -> Iterator[tuple[Target, LocalMesh]]:
    """A local mesh for `system` (and the systems differing from it only in the trigger's
    mode), as a Target; stopped after."""
    spec = MeshSpec(
        rankers=settings.rankers,
        ranker_args=("--model", settings.model.value, "--device", "cpu", *system.ranker_flags()),
        trigger_args=(
            "--slo-ms", str(settings.slo_ms), "--margin-ms", str(settings.margin_ms),
            "--expected-gap-ms", str(settings.gap_ms),
        ),
    )  # fmt: skip
    kind = "bypass" if system.bypass else "caching"
    print(f"starting a local {kind} mesh (rankers calibrate their cost model first) ...")
    with LocalMesh(spec) as mesh:
        assert mesh.trigger is not None
        yield Target(mesh.trigger.address, mesh.router_target, mesh.client_tls), mesh


def set_mode(system: System, mesh: LocalMesh | None, args: argparse.Namespace) -> None:
    """Put the trigger in the system's mode: a local mesh's, or a running one's via `--etcd`."""
    if mesh is not None:
        assert mesh.trigger is not None
        asyncio.run(set_trigger_mode(
            mesh.etcd_endpoint, mesh.trigger.address, system.trigger_mode,
            tls=mesh.client_tls, etcd_security=mesh.etcd_security,
        ))  # fmt: skip
    elif args.etcd is not None:
        asyncio.run(set_trigger_mode(args.etcd, args.trigger, system.trigger_mode))


def run(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """Every chosen system's search; the result file is rewritten after each system."""
    systems = [BY_LABEL[label] for label in args.modes]
    saved: dict[str, Any] = {
        "command": shlex.join(["relaygr", "loadgen", *args.argv]),
        "machine": machine_info(),  # at the start: the commit the run measured
        "target": "local mesh" if args.router is None else f"router {args.router}",
        "settings": {
            **{k: (v.value if isinstance(v, ModelPreset) else v)
               for k, v in dataclasses.asdict(settings).items()},
            "target_latency_ms": settings.gap_ms + settings.slo_ms,
            "smoke": args.smoke,
        },
        "modes": {},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for bypass in (True, False):
        chosen = [s for s in systems if s.bypass == bypass]
        if not chosen:
            continue
        with _target(args, settings, chosen[0]) as (target, mesh):
            if mesh is not None:
                saved["ranker_threads"] = mesh.ranker_threads
            for system in chosen:
                set_mode(system, mesh, args)
                saved["modes"][system.label] = search(
                    system, target, settings, args.out, args.smoke
                )
                write_result(args.result, saved)
    return saved


@contextmanager
def _target(
    args: argparse.Namespace, settings: Settings, system: System
) -> Iterator[tuple[Target, LocalMesh | None]]:
    if args.router is None:
        with local_target(settings, system) as (target, mesh):
            yield target, mesh
    else:
        yield Target(args.trigger, args.router, router_options=tuple(ROUTER_REPLICAS)), None


def write_result(path: Path, saved: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(saved, indent=2) + "\n")
    partial.replace(path)


# (smoke, search) defaults of the options a profile sets. LoadGen's early stopping at P99 needs
# about 460 queries with none over the target, so a search's tests run at least 500; a smoke
# test is shorter and its verdict says what it lacked.
PROFILE: dict[str, tuple[float, float]] = {
    "qps_from": (20.0, 10.0),
    "qps_min": (20.0, 2.5),
    "qps_max": (20.0, 80.0),
    "min_duration_s": (10.0, 10.0),
    "min_queries": (200, 500),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relaygr loadgen", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument(
        "--smoke", action="store_true",
        help="one test of relay sequence-aware at --qps-from on a local tiny mesh (under a minute)",
    )  # fmt: skip
    p.add_argument(
        "--modes", nargs="+", choices=[s.label for s in SYSTEMS], metavar="MODE",
        help=f"systems to measure, of {[s.label for s in SYSTEMS]} (default: all; --smoke: "
        f"{RELAY_AWARE.label})",
    )  # fmt: skip
    target = p.add_argument_group("a running mesh (default: start a local one)")
    target.add_argument(
        "--router", metavar="ADDR", help="its router, plaintext gRPC (default: none: local mesh)"
    )
    target.add_argument("--trigger", metavar="ADDR", help="its trigger (default: none)")
    target.add_argument(
        "--etcd", metavar="ENDPOINT",
        help="its etcd, to switch the trigger's mode per system (default: leave it as it is)",
    )  # fmt: skip
    mesh = p.add_argument_group("the local mesh and its traffic")
    mesh.add_argument(
        "--model", choices=[m.value for m in ModelPreset], default=ModelPreset.TINY.value,
        help="the rankers' model preset",
    )  # fmt: skip
    mesh.add_argument("--rankers", type=Bounded(int, AT_LEAST_ONE), default=2, help="rankers")
    mesh.add_argument(
        "--users",
        type=Bounded(int, AT_LEAST_ONE),
        default=100_000,
        help="the population (Zipf session starts, tooling.local.workload)",
    )
    mesh.add_argument(
        "--median-long-term",
        type=Bounded(int, AT_LEAST_ONE),
        default=256,
        help="median long-term history length (log-normal)",
    )
    mesh.add_argument("--max-long-term", type=Bounded(int, AT_LEAST_ONE), default=1024,
                      help="longest long-term history")  # fmt: skip
    mesh.add_argument("--gap-ms", type=Bounded(float, POSITIVE), default=50.0,
                      help="retrieval-to-ranking gap")  # fmt: skip
    mesh.add_argument("--slo-ms", type=Bounded(float, POSITIVE), default=150.0,
                      help="ranking P99 budget: LoadGen's target latency is gap + SLO")  # fmt: skip
    mesh.add_argument("--margin-ms", type=Bounded(float, POSITIVE), default=125.0,
                      help="trigger: at risk above SLO - margin of full inference")  # fmt: skip
    test = p.add_argument_group("the tests and the search")
    for name, text in (
        ("qps-from", "first target QPS"),
        ("qps-min", "lowest target QPS tried when the first test is not valid"),
        ("qps-max", "highest target QPS tried"),
        ("min-duration-s", "LoadGen's minimum duration of a test, seconds"),
    ):
        smoke, full = PROFILE[name.replace("-", "_")]
        test.add_argument(f"--{name}", type=Bounded(float, POSITIVE),
                          help=f"{text} (default: {full:g}; --smoke: {smoke:g})")  # fmt: skip
    test.add_argument("--qps-step", type=Bounded(float, POSITIVE), default=5.0,
                      help="the search's grid of target QPS")  # fmt: skip
    test.add_argument(
        "--min-queries", type=Bounded(int, AT_LEAST_ONE),
        help="LoadGen's minimum queries of a test: its early stopping at P99 wants ~460 or more"
        f" (default: {PROFILE['min_queries'][1]:g}; --smoke: {PROFILE['min_queries'][0]:g})",
    )  # fmt: skip
    test.add_argument("--timeout", type=Bounded(float, POSITIVE), default=10.0,
                      help="per-RPC deadline, seconds")  # fmt: skip
    test.add_argument(
        "--percentile", type=float, choices=PERCENTILES, default=PERCENTILE,
        help="the target latency's percentile (MLPerf's Server scenarios: 0.99; a lower one "
        "lets LoadGen's early stopping pass on fewer queries)",
    )  # fmt: skip
    test.add_argument(
        "--seed", type=int, help="population and LoadGen schedule seed (default: random)"
    )
    p.add_argument("--out", type=Path, default=Path("loadgen-results"),
                   help="LoadGen's logs, one folder per test")  # fmt: skip
    p.add_argument("--result", type=Path, help="the result file (default: OUT/loadgen.json)")
    return p


def settings_of(args: argparse.Namespace) -> Settings:
    for name, (smoke, full) in PROFILE.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    return Settings(
        model=ModelPreset(args.model),
        rankers=args.rankers,
        users=args.users,
        median_long_term=args.median_long_term,
        max_long_term=max(args.max_long_term, args.median_long_term),
        gap_ms=args.gap_ms,
        slo_ms=args.slo_ms,
        margin_ms=min(args.margin_ms, args.slo_ms),
        qps_from=args.qps_from,
        qps_min=min(args.qps_min, args.qps_from),
        qps_max=max(args.qps_max, args.qps_from),
        qps_step=args.qps_step,
        min_duration_s=args.min_duration_s,
        min_queries=int(args.min_queries),
        timeout_s=args.timeout,
        seed=args.seed,
        percentile=args.percentile,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    if (args.router is None) != (args.trigger is None):
        p.error("a running mesh needs both --router and --trigger")
    if args.smoke and args.router is not None:
        p.error("--smoke starts its own tiny mesh: leave out --router and --trigger")
    if args.seed is None:
        args.seed = secrets.randbelow(2**31)
        argv += ["--seed", str(args.seed)]
    args.argv = argv
    args.modes = args.modes or ([RELAY_AWARE.label] if args.smoke else [s.label for s in SYSTEMS])
    args.result = args.result or args.out / RESULT_FILE
    settings = settings_of(args)
    print(
        f"relaygr loadgen: MLPerf LoadGen Server scenario, target latency gap {settings.gap_ms:g}"
        f" + SLO {settings.slo_ms:g} ms at P{settings.percentile * 100:g}; modes {args.modes};"
        f" seed {settings.seed}",
        flush=True,
    )
    saved = run(args, settings)
    print()
    for label, mode in saved["modes"].items():
        print(f"{label}: highest valid QPS {mode['highest_valid_qps']:g}")
        for test in mode["runs"]:
            verdict = test["loadgen"]
            print(
                f"  {test['qps']:g} QPS: LoadGen {verdict['validity']}, "
                f"P{verdict['percentile'] * 100:g} {verdict['latency_ms']:.0f} ms, early stopping "
                f"{'met' if verdict['early_stopping_met'] else 'not met'}"
                f"{'' if test['valid'] else ' -> not valid'}"
            )
    print(f"result: {args.result}; LoadGen logs under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
