"""Fleet changes under steady load, with and without hand-off on drain and peer fetch.

Two changes, each on a fresh local mesh (etcd, rankers, a router, a trigger; separate
processes) under open-loop traffic of return visits, in two variants side by side:

- a rolling restart of every ranker, one at a time (SIGTERM: drain, then the same flags on the
  same port), 3 rankers;
- a scale-out from 3 rankers to 4.

`without` runs the rankers with `--no-handoff --no-peer-fetch` (the strongest system without
the feature: the same caches, tiers, router and directory); `with` runs them as shipped. The
trigger runs `off`: every hit is a prefix an earlier visit left (cache only), so a miss is
exactly a prefix the change lost. Per change it reports the Ranks' misses, failures, wrong
scores (every Rank checked against full inference of the rankers' own checkpoint), P99 during
the change against the steady window before it, and the prefix tokens recomputed by misses.

    .venv/bin/python bench/lifecycle_bench.py --seeds 2   # ~15 min on 2 cores
    .venv/bin/python bench/lifecycle_bench.py --quick     # a smoke run

Each run also keeps every miss during the change (when, where, how long) and the rankers' own
counters at its end (`COUNTED`: peer fetches by result, hand-offs received, tier drops), to
tell a prefix the hand-off never moved from one a fetch could not bring.
"""

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from bench.chaos import ChaosSettings, Traffic, wrong_scores
from bench.pipeline import ROOT, save_results
from bench.report import add_render_arguments, machine_info, publish, reproduce_lines, run_stamp
from bench.verdict import p99_ci, ranks_note
from relaygr.behaviours import RankInput
from relaygr.cli_help import HelpFormatter
from relaygr.cost import CostModel
from relaygr.tls import open_blocking_channel
from relaygr.v1 import ranker_pb2, ranker_pb2_grpc
from services.ranker.checkpoint import load_checkpoint, save_checkpoint
from services.ranker.model import RankingModel
from services.ranker.model_config import PRESETS, ModelPreset
from tooling.local.drive import OK, RequestRecord
from tooling.local.mesh import LocalMesh, MeshSpec
from tooling.local.ports import free_port_range
from tooling.local.processes import dying_with_parent, terminate
from tooling.local.scrape import scrape
from tooling.local.workload import Arrival, Population, WorkloadSpec, poisson_arrivals

NAME = "lifecycle_bench"
# The tiny preset: full inference of a 1k-token history takes milliseconds on one core, so
# five services and the driver share two cores and still meet a 5 s deadline through a restart.
MODEL = replace(PRESETS[ModelPreset.TINY], max_history_tokens=2048)
VARIANTS: dict[str, tuple[str, ...]] = {
    "without": ("--no-handoff", "--no-peer-fetch"),
    "with": (),
}
CHANGES = ("rolling restart", "scale-out 3 -> 4")
# The control: the CPU of one ranker's start-up (torch, the model, calibration) on this machine,
# with no traffic moved: a ranker process starts beside the mesh, without joining it, and stops.
CONTROL = "control: a ranker starts beside the mesh"
# `--changes` names each change by one word.
CHANGE_NAMES = {"restart": CHANGES[0], "scale-out": CHANGES[1], "control": CONTROL}
# The rankers' counters kept at a run's end (summed over the rankers then serving): peer fetches
# by result, hand-off streams and entries received, entries dropped from a tier by reason.
COUNTED = (
    "relaygr_ranker_fetch_seconds_count",
    "relaygr_ranker_fetch_seconds_sum",
    "relaygr_ranker_handoff_received_streams_total",
    "relaygr_ranker_handoff_admitted_entries_total",
    "relaygr_ranker_handoff_refused_entries_total",
    "relaygr_ranker_kv_drops_total",
)


@dataclass(frozen=True, slots=True)
class Settings:
    rate: float = 20.0  # visits per second
    users: int = 150
    warm_s: float = 25.0  # traffic before the steady window: users' prefixes get cached
    steady_s: float = 20.0  # the steady window the change is compared with (~400 Ranks)
    after_s: float = 15.0  # traffic after the change ends, still counted as during it
    timeout_s: float = 5.0
    hbm_mb: int = 96
    dram_mb: int = 192


@dataclass(frozen=True, slots=True)
class Window:
    """The Ranks sent in one window of a run."""

    sent: int
    failed: int
    misses: int
    fetched: int  # served from a prefix fetched from a peer
    recomputed_tokens: int  # prefix tokens the misses computed again
    recomputed_ms: float  # their prefill, as the rankers' calibrated cost model prices it
    p50_ms: float
    p99_ms: float
    seconds: float
    # Every answered Rank's latency, 0.01 ms (empty in runs saved before they were kept).
    latencies_ms: list[float] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        records: Sequence[RequestRecord],
        arrivals: Sequence[Arrival],
        seconds: float,
        cost: CostModel,
    ) -> "Window":
        ok = [r for r in records if r.status == OK]
        misses = [r for r in ok if not r.hit]
        latencies = np.array([r.latency_s * 1e3 for r in ok]) if ok else np.zeros(1)
        tokens = [arrivals[r.index].request.prefix.num_tokens for r in misses]
        return cls(
            sent=len(records),
            failed=len(records) - len(ok),
            misses=len(misses),
            fetched=sum(r.outcome == "peer_fetched" for r in ok),
            recomputed_tokens=sum(tokens),
            recomputed_ms=sum(cost.prefill_ms(n) for n in tokens),
            p50_ms=float(np.percentile(latencies, 50)),
            p99_ms=float(np.percentile(latencies, 99)),
            seconds=seconds,
            latencies_ms=[round(r.latency_s * 1e3, 2) for r in ok],
        )


@dataclass(frozen=True, slots=True)
class Slow:
    """One of the slowest Ranks during a change: when it was due (s from the change's start),
    its latency, the ranker's own time for it, its cache outcome and the ranker that served it."""

    at_s: float
    latency_ms: float
    server_ms: float
    outcome: str
    instance: str


@dataclass(frozen=True, slots=True)
class Missed:
    """One miss during a change: when it was due (s from the change's start), the ranker that
    computed the prefix, its length and predicted prefill (the rankers' calibrated cost model),
    and whether it was the user's first Rank of the run (a cold miss: no earlier visit left a
    prefix for the change to lose)."""

    at_s: float
    instance: str
    prefix_tokens: int
    prefill_ms: float
    first_visit: bool


@dataclass(frozen=True, slots=True)
class Step:
    """One ranker's part of a change (its restart, or its start): from and to, s from the
    change's start."""

    ranker: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class ChangeRun:
    variant: str
    change: str
    seed: int
    steady: Window
    during: Window  # from the change's start to `after_s` past its end
    after: Window  # the last part of `during`: the `after_s` past the change's end
    change_s: float  # how long the change itself took
    checked: int
    wrong_scores: int
    # Where the tail of `during` sat (empty in runs saved before they were kept).
    slowest: list[Slow] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    # Every miss during the change, and the rankers' `COUNTED` counters at the run's end, as
    # "name{labels}": value (both empty in runs saved before they were kept).
    missed: list[Missed] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)


SLOWEST = 8  # the slowest Ranks of each change kept: a P99 over ~400 Ranks is among them


def mesh_spec(checkpoint: Path, variant: str, settings: Settings) -> MeshSpec:
    ranker = (
        "--checkpoint", str(checkpoint), "--device", "cpu", "--calibration-lengths", "64,256",
        "--hbm-budget-mb", str(settings.hbm_mb), "--dram-budget-mb", str(settings.dram_mb),
        "--lease-ttl-s", "2", *VARIANTS[variant],
    )  # fmt: skip
    return MeshSpec(
        rankers=3,
        ranker_args=ranker,
        trigger_args=("--mode", "off"),
        metrics_base_port=free_port_range(6),  # 4 rankers at most, a router, a trigger
    )


def workload(settings: Settings, seed: int) -> WorkloadSpec:
    """Return visits with unchanged histories: in steady state every visit of a cached user
    hits, so what a change loses shows as misses."""
    return WorkloadSpec(
        users=settings.users, zipf_s=0.3, median_long_term=768, long_term_sigma=0.4,
        min_long_term=128, max_long_term=1536, short_term=(8, 32), candidates=32,
        user_features=4, gap_s=0.05, revisit_p=0.0, new_behaviours_p=0.0,
        user_prefix=f"u{seed}",
    )  # fmt: skip


def rolling_restart(mesh: LocalMesh) -> list[tuple[str, float, float]]:
    """Restart every ranker in turn: (ranker, start, end) of each, monotonic seconds."""
    steps = []
    for ranker in list(mesh.rankers):
        start = time.monotonic()
        mesh.restart(ranker.name)
        steps.append((ranker.name, start, time.monotonic()))
    return steps


def scale_out(mesh: LocalMesh) -> list[tuple[str, float, float]]:
    start = time.monotonic()
    added = mesh.add_ranker()
    return [(added.name, start, time.monotonic())]


def ranker_start_alone(mesh: LocalMesh) -> list[tuple[str, float, float]]:
    """Start a ranker with the mesh's ranker flags but no etcd (it joins nothing), wait until
    it serves, stop it."""
    args = list(mesh.rankers[0].args)
    at = args.index("--etcd-endpoints")
    del args[at : at + 2]
    args[args.index("--listen") + 1] = "127.0.0.1:0"
    args[args.index("--instance-id") + 1] = "bystander"
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="relaygr-bystander-") as tmp:
        log = Path(tmp) / "ranker.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                dying_with_parent([sys.executable, "-m", "tooling.cli", *args]),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 300
            while "listening on port" not in log.read_text(errors="replace"):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the bystander ranker did not start:\n{log.read_text()}")
                time.sleep(0.05)  # poll interval under a deadline
        finally:
            terminate(process, 30.0)
    return [("bystander", start, time.monotonic())]


def run_change(
    change: str,
    variant: str,
    seed: int,
    settings: Settings,
    checkpoint: Path,
    reference: Callable[[RankInput], np.ndarray],
    model_version: str,
) -> ChangeRun:
    """One fresh mesh: warm-up, the steady window, the change, `after_s` more; the books."""
    act = {CHANGES[0]: rolling_restart, CHANGES[1]: scale_out, CONTROL: ranker_start_alone}[change]
    rng = np.random.default_rng(seed)
    population = Population(workload(settings, seed), rng)
    horizon = settings.warm_s + settings.steady_s + 300.0 + settings.after_s
    arrivals = poisson_arrivals(population, settings.rate, horizon)
    chaos = ChaosSettings(rate=settings.rate, gap_s=0.05, timeout_s=settings.timeout_s)
    with LocalMesh(mesh_spec(checkpoint, variant, settings)) as mesh:
        traffic = Traffic(mesh, arrivals, chaos)
        traffic.begin()
        try:
            steady_from = settings.warm_s
            change_from = steady_from + settings.steady_s
            time.sleep(max(0.0, traffic.start + change_from - time.monotonic()))
            started = time.monotonic() - traffic.start
            steps = [
                Step(name, a - traffic.start - started, b - traffic.start - started)
                for name, a, b in act(mesh)
            ]
            ended = time.monotonic() - traffic.start
        finally:
            traffic.stop_after((time.monotonic() - traffic.start) + settings.after_s)
            traffic.join()
        cost = _cost_model(mesh)
        counters = ranker_counters(r.entry.metrics for r in mesh.rankers)
    records = traffic.records
    steady = [r for r in records if steady_from <= r.at < started]
    during = [r for r in records if started <= r.at < ended + settings.after_s]
    after = [r for r in during if r.at >= ended]
    checked, wrong = wrong_scores(records, arrivals, reference, model_version, chaos, rng)
    return ChangeRun(
        variant=variant,
        change=change,
        seed=seed,
        steady=Window.of(steady, arrivals, started - steady_from, cost),
        during=Window.of(during, arrivals, ended + settings.after_s - started, cost),
        after=Window.of(after, arrivals, settings.after_s, cost),
        change_s=ended - started,
        checked=checked,
        wrong_scores=wrong,
        slowest=_slowest(during, started),
        steps=steps,
        missed=missed_ranks(records, arrivals, started, ended + settings.after_s, cost),
        counters=counters,
    )


def ranker_counters(urls: Iterable[str | None]) -> dict[str, float]:
    """The `COUNTED` samples scraped from each ranker's /metrics (None: not served), summed,
    as "name{labels}"."""
    total: dict[str, float] = {}
    for url in urls:
        if url is None:
            continue
        for sample in scrape(url):
            if sample.name in COUNTED and sample.value:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                name = f"{sample.name}{{{labels}}}"
                total[name] = total.get(name, 0.0) + sample.value
    return dict(sorted(total.items()))


def _slowest(records: Sequence[RequestRecord], started: float) -> list[Slow]:
    ok = sorted((r for r in records if r.status == OK), key=lambda r: r.latency_s)
    return [_rank(r, started) for r in ok[-SLOWEST:][::-1]]


def missed_ranks(
    records: Sequence[RequestRecord],
    arrivals: Sequence[Arrival],
    started: float,
    until: float,
    cost: CostModel,
) -> list[Missed]:
    """The misses of Ranks due from `started` to `until` (s from the traffic's start)."""
    seen: set[str] = set()
    missed = []
    for r in sorted(records, key=lambda r: r.at):
        prefix = arrivals[r.index].request.prefix
        first = prefix.user_id not in seen
        seen.add(prefix.user_id)
        if started <= r.at < until and r.status == OK and not r.hit:
            at = round(r.at - started, 3)
            tokens = prefix.num_tokens
            missed.append(Missed(at, r.instance, tokens, round(cost.prefill_ms(tokens), 2), first))
    return missed


def _rank(r: RequestRecord, started: float) -> Slow:
    return Slow(
        round(r.at - started, 3), round(r.latency_s * 1e3, 2), round(r.server_ms, 2),
        r.outcome, r.instance,
    )  # fmt: skip


def _cost_model(mesh: LocalMesh) -> CostModel:
    """The calibrated cost model of the mesh's first ranker, as it publishes it."""
    with open_blocking_channel(mesh.rankers[0].address, mesh.client_tls) as channel:
        info = ranker_pb2_grpc.RankerServiceStub(channel).Describe(
            ranker_pb2.DescribeRequest(), timeout=30
        )
    c = info.cost_model
    return CostModel(
        c.fixed_ms, c.per_token_ms, c.per_pair_ms, c.per_candidate_key_ms, c.reload_ms_per_mb
    )


def run(args: argparse.Namespace) -> dict:
    started = machine_info()  # the commit this run measures, stamped before it runs
    settings = Settings(
        rate=args.rate,
        users=args.users,
        warm_s=args.warm,
        steady_s=args.steady,
        after_s=args.after,
    )
    seeds = [args.seed + k for k in range(args.seeds)]
    runs: list[ChangeRun] = []
    with tempfile.TemporaryDirectory(prefix="relaygr-lifecycle-") as tmp:
        checkpoint = save_checkpoint(RankingModel(MODEL, seed=args.seed), Path(tmp))
        model = load_checkpoint(checkpoint)
        torch.set_num_threads(1)

        def reference(request: RankInput) -> np.ndarray:
            return model.full_forward(request).numpy()

        for seed in seeds:
            for change, variant in plan(seed, args.changes, args.variants):
                result = run_change(
                    change, variant, seed, settings, checkpoint, reference, model.model_version
                )
                runs.append(result)
                print(_row(result), flush=True)
    return save_results(
        NAME,
        args,
        {"runs": [dataclasses.asdict(r) for r in runs], "settings": dataclasses.asdict(settings)},
        started,
        1,
    )


def plan(seed: int, changes: Sequence[str], variants: Sequence[str]) -> list[tuple[str, str]]:
    """The (change, variant) runs of one seed: each change of `changes` (`CHANGE_NAMES` keys)
    in each variant of `variants`, alternating which variant runs first so that drift on the
    machine spreads over both; the control runs `with` only."""
    runs = []
    for name in changes:
        change = CHANGE_NAMES[name]
        if change == CONTROL:
            runs += [(change, "with")] if "with" in variants else []
            continue
        order = [v for v in VARIANTS if v in variants]
        runs += [(change, v) for v in (order if seed % 2 == 0 else order[::-1])]
    return runs


def _p99(w: Window) -> str:
    """A window's P99, with its bootstrap 95% interval when its latencies were kept."""
    return f"{w.p99_ms:.0f}" + (f" ({p99_ci(w.latencies_ms)})" if w.latencies_ms else "")


def _row(r: ChangeRun) -> str:
    d, s, a = r.during, r.steady, r.after
    return (
        f"| {r.change} | {r.variant} | {r.seed} | {d.sent} | {d.failed} | {d.misses} "
        f"| {d.fetched} | {d.recomputed_tokens:,} ({d.recomputed_ms / 1e3:.1f} s) "
        f"| {_p99(s)} | {_p99(d)} "
        f"({d.p99_ms / s.p99_ms:.2f}x) | {a.p99_ms:.0f} ({a.p99_ms / s.p99_ms:.2f}x) "
        f"| {r.change_s:.1f} | {r.wrong_scores} of {r.checked} |"
    )


def _load(saved: dict) -> list[ChangeRun]:
    runs = []
    for raw in saved["runs"]:
        steady, during, after = (Window(**raw.pop(name)) for name in ("steady", "during", "after"))
        slowest = [Slow(**x) for x in raw.pop("slowest", [])]
        steps = [Step(**x) for x in raw.pop("steps", [])]
        missed = [Missed(**x) for x in raw.pop("missed", [])]
        runs.append(
            ChangeRun(
                **raw,
                steady=steady,
                during=during,
                after=after,
                slowest=slowest,
                steps=steps,
                missed=missed,
            )
        )
    return runs


def render(saved: dict) -> str:
    runs = _load(saved)
    s = Settings(**saved["settings"])
    lines = [
        f"## Fleet changes: hand-off on drain and peer fetch{_subset(runs)}",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. Local mesh per run: etcd, 3 rankers (CPU, the tiny "
        f"model, one thread each, device tier {s.hbm_mb} MiB, host tier {s.dram_mb} MiB), a "
        "router, a trigger in mode `off` (cache only: every hit is a prefix an earlier visit "
        "left). `without`: rankers run `--no-handoff --no-peer-fetch`; `with`: as shipped.",
        f"- Traffic: open-loop Poisson, {s.rate:g} visits/s over {s.users} users (Zipf 0.3), "
        f"histories of 128-1,536 tokens that do not change between visits; {s.warm_s:g} s of "
        f"warm-up, a {s.steady_s:g} s steady window, the change, then {s.after_s:g} s more, "
        "counted as during the change. Every successful Rank is checked against full "
        "inference (relative error <= 1e-5).",
        *([CONTROL_NOTE] if any(r.change == CONTROL for r in runs) else []),
        "",
        "| change | variant | seed | Ranks during | failed | misses | peer-fetched "
        "| recomputed prefix tokens (prefill time) | steady P99 ms (95% CI) "
        "| P99 during ms (95% CI) | P99 after ms "
        "| change took s | wrong scores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *(_row(r) for r in runs),
    ]
    compared: list[str] = []

    def ratios(runs: list[ChangeRun], window: str) -> str:
        return ", ".join(f"{getattr(r, window).p99_ms / r.steady.p99_ms:.2f}" for r in runs)

    for change in CHANGES:
        without = [r for r in runs if r.change == change and r.variant == "without"]
        with_ = [r for r in runs if r.change == change and r.variant == "with"]
        if not without or not with_:
            continue
        w0 = sum(r.during.misses for r in without)
        w1 = sum(r.during.misses for r in with_)
        fewer = f"{1 - w1 / w0:.0%} pooled" if w0 else "n/a"
        paired = {r.seed: r.during.misses for r in with_}
        each = [1 - paired[r.seed] / r.during.misses for r in without if r.seed in paired]
        if each and all(r.during.misses for r in without):
            fewer += f"; per seed {', '.join(f'{x:.0%}' for x in each)}"
        compared.append(
            f"| {change} | {', '.join(str(r.during.misses) for r in without)} "
            f"| {', '.join(str(r.during.misses) for r in with_)} | {fewer} "
            f"| {ratios(without, 'during')} | {ratios(with_, 'during')} "
            f"| {ratios(with_, 'after')} |"
        )
    controls = [r for r in runs if r.change == CONTROL]
    if compared and controls:
        compared.append(
            f"| {CONTROL} | | | | | {ratios(controls, 'during')} | {ratios(controls, 'after')} |"
        )
    if compared:
        lines += [
            "",
            "| change | misses without (per seed) | misses with | fewer misses | P99 during / "
            "steady, without | with | P99 after / steady, with |",
            "|---|---|---|---:|---|---|---|",
            *compared,
        ]
    windows = [w for r in runs for w in (r.steady, r.during)]
    few = ranks_note((w.sent - w.failed for w in windows), per="window")
    if few:
        lines += ["", f"P99 and its ratios: {few}; such a P99 is one of its slowest few Ranks."]
    tails = [r for r in runs if r.slowest and r.change != CONTROL]
    if tails:
        lines += [
            "",
            f"Where the tail sat: the {SLOWEST} slowest Ranks during each change (s from its "
            "start: latency ms / the ranker's own ms, outcome, ranker), and each ranker's "
            "part of the change (restarted or started, s from its start).",
            "",
            "| change | variant | seed | slowest Ranks | steps |",
            "|---|---|---:|---|---|",
            *(_tail(r) for r in tails),
        ]
    counted = [r for r in runs if r.counters or r.missed]
    if counted:
        lines += [
            "",
            "What the misses were: each miss during the change (s from its start: the ranker "
            "that computed it, the prefix's tokens / its predicted prefill ms; `first`: the "
            "user's first Rank of the run, a cold miss no change caused), and the rankers' own "
            "counters at the run's end, summed over the rankers then serving (a restarted ranker "
            "counts from its restart; a drained process's counters leave with it): peer fetches "
            "by result (their mean time), hand-off entries received (admitted by tier, refused "
            "by reason), and prefixes dropped from a tier.",
            "",
            "| change | variant | seed | misses during | fetches | hand-off received | dropped |",
            "|---|---|---:|---|---|---|---|",
            *(_counted(r) for r in counted),
        ]
    return "\n".join(lines)


CONTROL_NOTE = (
    f"- The control ({CONTROL}, once per seed): a ranker process with the same flags starts "
    "beside the mesh without joining it, up to serving, and stops. It moves no traffic and "
    "no cache: what its window's P99 shows is the CPU a ranker's start-up (torch, the "
    "model, calibration) takes from the mesh on this 2-core machine, which a restart and a "
    "scale-out pay too (on a cluster, a new ranker starts on its own node)."
)


def _subset(runs: Sequence[ChangeRun]) -> str:
    """A title's note of which runs a partial run (`--changes`, `--variants`) made."""
    made = {(r.change, r.variant) for r in runs}
    every = set(plan(0, list(CHANGE_NAMES), list(VARIANTS)))  # what a full run makes
    if made >= every:
        return ""
    return " (only " + "; ".join(f"{c}, {v}" for c, v in sorted(made)) + ")"


def _counted(r: ChangeRun) -> str:
    missed = "; ".join(
        f"{x.at_s:.1f}: {x.instance} {x.prefix_tokens}/{x.prefill_ms:.1f}"
        + (" first" if x.first_visit else "")
        for x in r.missed
    )

    def part(prefix: str) -> str:
        found = [
            f"{name[len(prefix) :].strip('{}')} {value:g}".strip()
            for name, value in r.counters.items()
            if name.startswith(prefix)
        ]
        return ", ".join(found) or "none"

    received = (
        f"{part('relaygr_ranker_handoff_received_streams_total')} streams; "
        f"admitted {part('relaygr_ranker_handoff_admitted_entries_total')}; "
        f"refused {part('relaygr_ranker_handoff_refused_entries_total')}"
    )
    return (
        f"| {r.change} | {r.variant} | {r.seed} | {missed or 'none'} "
        f"| {_fetches(r.counters)} | {received} "
        f"| {part('relaygr_ranker_kv_drops_total')} |"
    )


def _fetches(counters: dict[str, float]) -> str:
    """Peer fetches by result, each with its mean time."""
    count, total = "relaygr_ranker_fetch_seconds_count", "relaygr_ranker_fetch_seconds_sum"
    found = []
    for name, n in counters.items():
        if name.startswith(count):
            labels = name[len(count) :]
            mean_ms = 1e3 * counters.get(total + labels, 0.0) / n
            found.append(f"{labels.strip('{}')} {n:g} ({mean_ms:.1f} ms)")
    return ", ".join(found) or "none"


def _tail(r: ChangeRun) -> str:
    slow = "; ".join(
        f"{x.at_s:.1f}: {x.latency_ms:.0f}/{x.server_ms:.0f} {x.outcome} {x.instance}"
        for x in r.slowest
    )
    steps = "; ".join(f"{x.ranker} {x.start_s:.1f}-{x.end_s:.1f}" for x in r.steps)
    return f"| {r.change} | {r.variant} | {r.seed} | {slow} | {steps} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    defaults = Settings()
    parser.add_argument("--rate", type=float, default=defaults.rate, help="visits per second")
    parser.add_argument("--users", type=int, default=defaults.users, help="population size")
    parser.add_argument("--warm", type=float, default=defaults.warm_s, help="warm-up seconds")
    parser.add_argument(
        "--steady", type=float, default=defaults.steady_s, help="steady window, seconds"
    )
    parser.add_argument(
        "--after", type=float, default=defaults.after_s, help="seconds after the change"
    )
    parser.add_argument("--seeds", type=int, default=2, help="seeds, each a pair of runs")
    parser.add_argument(
        "--seed",
        type=int,
        default=int.from_bytes(os.urandom(4), "little"),
        help="first seed (default: random)",
    )
    parser.add_argument(
        "--changes",
        type=lambda text: text.split(","),
        default=list(CHANGE_NAMES),
        help=f"comma-separated, of {', '.join(CHANGE_NAMES)}",
    )
    parser.add_argument(
        "--variants",
        type=lambda text: text.split(","),
        default=list(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)}",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run's sizes")
    add_render_arguments(parser)
    parser.add_argument("--tag", default="", help="results and doc section get _TAG")
    args = parser.parse_args()
    unknown = set(args.changes) - set(CHANGE_NAMES) | set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown change or variant: {', '.join(sorted(unknown))}")
    if args.quick and args.from_json is None:
        args.seeds, args.warm, args.steady, args.after, args.users = 1, 8.0, 4.0, 4.0, 60
        args.no_docs = True
    name = f"{NAME}_{args.tag}" if args.tag else NAME
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
