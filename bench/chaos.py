"""Chaos under load: faults injected into a LocalMesh while open-loop traffic runs through it.

Every Rank of a phase is accounted for: it succeeded (and, sampled, its scores equal full
inference of the same checkpoint), or failed with a status, or hung (no answer by its deadline
plus a grace). A phase is steady traffic, then the fault (which returns when it is over: the
service is back and SERVING), then more traffic in which recovery is measured. The traffic is
`tooling.local.drive`'s open-loop driver (schedule fixed before anything is sent), so a stalled
mesh cannot slow the clock. Faults run on the calling thread: restarted children die with the
thread that started them, so call from the thread that started the mesh.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from relaygr.behaviours import RankInput
from services.ranker.model_config import PRESETS, ModelPreset
from tooling.local.drive import HUNG, OK, OpenLoopDriver, RequestRecord
from tooling.local.mesh import ROUTER_REPLICAS, LocalMesh, MeshSpec
from tooling.local.workload import Arrival, Population, WorkloadSpec, poisson_arrivals

# A client may retry these: the request was not served, and another try can be.
RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})


@dataclass(frozen=True, slots=True)
class ChaosSettings:
    rate: float = 10.0  # Poisson arrivals per second: a retrieval event, then its Rank
    before_s: float = 2.0  # steady traffic before each fault
    after_s: float = 5.0  # traffic after a fault ends, in which recovery is measured
    fault_budget_s: float = 90.0  # the longest a fault may take (a ranker restart included)
    gap_s: float = 0.3  # retrieval event -> Rank
    timeout_s: float = 5.0  # every RPC's deadline
    hang_grace_s: float = 2.0  # an RPC with no answer this long past its deadline hung
    verify_share: float = 1.0  # share of successful Ranks checked against full inference
    recovered_after: int = 10  # Ranks, all hits, up to a phase's end: the mesh has recovered
    tolerance: float = 1e-5  # relative error allowed against full inference (fp32 KV)


@dataclass(frozen=True, slots=True)
class Fault:
    """`inject` does the damage and undoes it; it returns once the mesh could serve again."""

    name: str
    inject: Callable[[LocalMesh], None]


def no_fault() -> Fault:
    return Fault("none (steady traffic)", lambda mesh: None)


def kill_ranker(name: str = "ranker-0", down_s: float = 0.0) -> Fault:
    """SIGKILL, `down_s` dead (past its lease, it leaves the membership), restart."""

    def inject(mesh: LocalMesh) -> None:
        mesh.kill(name)
        time.sleep(down_s)
        mesh.restart(name)

    return Fault(f"{name} killed (-9), restarted after {down_s:g} s", inject)


def etcd_outage(down_s: float) -> Fault:
    def inject(mesh: LocalMesh) -> None:
        mesh.stop_etcd()
        time.sleep(down_s)
        mesh.start_etcd()

    return Fault(f"etcd stopped {down_s:g} s and restarted", inject)


def restart_router(name: str = "router") -> Fault:
    def inject(mesh: LocalMesh) -> None:
        mesh.restart(name)

    return Fault(f"{name} restarted (a second replica serves)", inject)


def slow_ranker(
    name: str = "ranker-1", stopped_s: float = 0.3, period_s: float = 1.0, for_s: float = 4.0
) -> Fault:
    """The ranker's process is frozen (SIGSTOP) `stopped_s` of every `period_s`: a stalled
    host, as a GC pause or a noisy neighbour makes one, that keeps its connections open."""

    def inject(mesh: LocalMesh) -> None:
        process = mesh.service(name).process
        end = time.monotonic() + for_s
        try:
            while time.monotonic() < end:
                process.send_signal(signal.SIGSTOP)
                time.sleep(stopped_s)
                process.send_signal(signal.SIGCONT)
                time.sleep(period_s - stopped_s)
        finally:
            process.send_signal(signal.SIGCONT)

    return Fault(f"{name} slow (frozen {stopped_s:g} s of every {period_s:g} s)", inject)


def freeze_ranker(name: str = "ranker-1", for_s: float = 8.0) -> Fault:
    """One long freeze: past its lease (it leaves the membership, then must re-register by
    itself) and past the deadline of every Rank sent to it meanwhile."""

    def inject(mesh: LocalMesh) -> None:
        process = mesh.service(name).process
        process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(for_s)
        finally:
            process.send_signal(signal.SIGCONT)

    return Fault(f"{name} frozen {for_s:g} s (past its lease)", inject)


def standard_faults(
    ranker_down_s: float = 2.0,
    etcd_down_s: float = 3.0,
    slow_for_s: float = 4.0,
    stopped_s: float = 0.3,
    period_s: float = 1.0,
) -> list[Fault]:
    """The faults of issue 9, in order, after a fault-free control phase."""
    return [
        no_fault(),
        kill_ranker("ranker-0", ranker_down_s),
        etcd_outage(etcd_down_s),
        restart_router("router"),
        slow_ranker("ranker-1", stopped_s, period_s, slow_for_s),
    ]


# Small enough that checking every Rank against full inference costs milliseconds: the tiny
# preset, its histories capped at 2,048 tokens (the flood sizes its prefixes by the cap).
CHAOS_MODEL = replace(PRESETS[ModelPreset.TINY], max_history_tokens=2048)


def chaos_mesh_spec(
    checkpoint: Path, log_dir: Path | None = None, metrics_base_port: int = 0
) -> MeshSpec:
    """Two rankers of `checkpoint`, two routers, a trigger relaying every event (mode `all`):
    steady traffic then hits every time, so any miss is the fault's doing. With
    `metrics_base_port`, the five services serve /metrics on consecutive ports from it."""
    ranker = (
        "--checkpoint", str(checkpoint), "--device", "cpu", "--calibration-lengths", "32,64",
        "--hbm-budget-mb", "24", "--dram-budget-mb", "24", "--lease-ttl-s", "2",
    )  # fmt: skip
    return MeshSpec(
        rankers=2,
        ranker_args=ranker,
        routers=2,
        # A frozen ranker's Ranks go to the other one after 1 s instead of waiting it out.
        router_args=("--rank-hedge-ms", "1000"),
        trigger_args=("--mode", "all"),
        log_dir=log_dir,
        metrics_base_port=metrics_base_port,
    )


def chaos_workload(users: int = 80) -> WorkloadSpec:
    """Histories the tiny chaos model serves in milliseconds; return visits repeat the user's
    history. A changed history supersedes the user's older prefix on its ranker, so a hot
    user's overlapping visits would miss now and then by design, blurring what a fault does.
    A small, skewed population with no session returns: every visit is a Zipf draw."""
    return WorkloadSpec(
        users=users, median_long_term=256, long_term_sigma=0.5, min_long_term=32,
        max_long_term=1024, short_term=(8, 32), candidates=16, user_features=4, gap_s=0.3,
        new_behaviours_p=0.0, zipf_s=1.1, revisit_p=0.0,
    )  # fmt: skip


@dataclass(slots=True)
class FaultReport:
    fault: str
    sent: int
    succeeded: int
    failed: dict[str, int]  # by status (HUNG included)
    hung: int
    unexpected: int  # failures with a status a client cannot retry
    verified: int  # successful Ranks whose scores were checked
    wrong_scores: int
    misses: int  # successful Ranks served by full inference
    fault_start_s: float  # from the phase start
    fault_end_s: float
    recovery_s: float | None  # fault end -> full hit rate for good; None: not within the phase
    served_by: dict[str, int]  # successful Ranks per ranker
    decisions: dict[str, int]  # the trigger's answers by reason, or failure status

    @property
    def passed(self) -> bool:
        return (
            self.sent > 0
            and not self.hung
            and not self.unexpected
            and not self.wrong_scores
            and self.recovery_s is not None
        )


def recovery_s(records: Sequence[RequestRecord], fault_end_s: float, tail: int) -> float | None:
    """Seconds from the fault's end to the first Rank after which every Rank of the phase is a
    hit (0 when no Rank missed after the fault ended); None unless `tail` Ranks follow."""
    ordered = sorted(records, key=lambda r: r.at)
    bad = [k for k, r in enumerate(ordered) if not r.hit]
    first_good = bad[-1] + 1 if bad else 0
    if len(ordered) - first_good < tail:
        return None
    return max(0.0, ordered[first_good].at - fault_end_s)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max|a - b| / max|b|: relative to the scale of the scores."""
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(actual.astype(np.float64) - expected).max()) / scale


def wrong_scores(
    records: Sequence[RequestRecord],
    arrivals: Sequence[Arrival],
    reference: Callable[[RankInput], np.ndarray],
    model_version: str,
    settings: ChaosSettings,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """(checked, wrong) over a `verify_share` sample of the successful Ranks."""
    checked = wrong = 0
    for record in records:
        if record.status != "OK" or rng.random() >= settings.verify_share:
            continue
        checked += 1
        expected = reference(arrivals[record.index].request)
        scores = record.scores
        if (
            record.model_version != model_version
            or scores is None
            or scores.shape != expected.shape
            or not relative_error(scores, expected) <= settings.tolerance
        ):
            wrong += 1
    return checked, wrong


class Traffic:
    """One phase's arrivals, sent by an `OpenLoopDriver` on a thread and loop of their own (the
    fault runs on the calling thread); `stop_after` ends the schedule."""

    def __init__(self, mesh: LocalMesh, arrivals: Sequence[Arrival], settings: ChaosSettings):
        assert mesh.trigger is not None and mesh.routers, "mesh not started"
        self._router_target = mesh.router_target
        self._trigger_address = mesh.trigger.address
        self._tls = mesh.client_tls
        self._arrivals = arrivals
        self._settings = settings
        self._driver = OpenLoopDriver(
            arrivals,
            label="chaos",
            gap_s=settings.gap_s,
            timeout_s=settings.timeout_s,
            hang_grace_s=settings.hang_grace_s,
            keep_scores=True,
        )
        self.records: list[RequestRecord] = []
        self._error: BaseException | None = None
        self.start = time.monotonic() + 0.2
        self._thread = threading.Thread(target=self._run, daemon=True)

    def begin(self) -> None:
        self._thread.start()

    def stop_after(self, seconds: float) -> None:
        """Send no arrival later than `seconds` from the start."""
        self._driver.stop_after = seconds

    def join(self) -> None:
        timeout = self._settings.timeout_s + self._settings.hang_grace_s + 30.0
        self._thread.join(timeout=self._arrivals[-1].at + timeout if self._arrivals else timeout)
        if self._thread.is_alive():
            raise RuntimeError("chaos traffic did not finish: the driver itself hung")
        if self._error is not None:
            raise RuntimeError("chaos traffic failed") from self._error

    def _run(self) -> None:
        try:
            self.records = asyncio.run(
                self._driver.run(
                    self._trigger_address,
                    self._router_target,
                    tls=self._tls,
                    router_options=ROUTER_REPLICAS,
                    start=self.start,
                )
            )
        except BaseException as err:  # handed to the phase's thread by join()
            self._error = err


def run_phase(
    mesh: LocalMesh,
    fault: Fault,
    population: Population,
    settings: ChaosSettings,
    reference: Callable[[RankInput], np.ndarray],
    model_version: str,
    rng: np.random.Generator,
) -> FaultReport:
    """Steady traffic, the fault, traffic until `after_s` past its end; then the books."""
    horizon = settings.before_s + settings.fault_budget_s + settings.after_s
    arrivals = poisson_arrivals(population, settings.rate, horizon)
    traffic = Traffic(mesh, arrivals, settings)
    traffic.begin()
    try:
        time.sleep(max(0.0, traffic.start + settings.before_s - time.monotonic()))
        fault_start = time.monotonic() - traffic.start
        fault.inject(mesh)
        fault_end = time.monotonic() - traffic.start
    finally:
        # Ends the schedule even if the fault failed, so the traffic thread finishes.
        traffic.stop_after((time.monotonic() - traffic.start) + settings.after_s)
        traffic.join()
    if fault_end + settings.after_s > horizon:
        raise RuntimeError(f"{fault.name}: took {fault_end - fault_start:.0f} s, over budget")
    records = traffic.records
    statuses = Counter(r.status for r in records if r.status != OK)
    checked, wrong = wrong_scores(records, arrivals, reference, model_version, settings, rng)
    return FaultReport(
        fault=fault.name,
        sent=len(records),
        succeeded=sum(r.status == OK for r in records),
        failed=dict(statuses),
        hung=statuses[HUNG],
        unexpected=sum(n for st, n in statuses.items() if st not in RETRYABLE and st != HUNG),
        verified=checked,
        wrong_scores=wrong,
        misses=sum(r.status == OK and not r.hit for r in records),
        fault_start_s=fault_start,
        fault_end_s=fault_end,
        recovery_s=recovery_s(records, fault_end, settings.recovered_after),
        served_by=dict(Counter(r.instance for r in records if r.status == OK)),
        decisions=dict(
            Counter(
                r.decision if r.decision_status == OK else r.decision_status
                for r in records
                if r.decision_status
            )
        ),
    )


def run_chaos(
    mesh: LocalMesh,
    faults: Sequence[Fault],
    population: Population,
    settings: ChaosSettings,
    reference: Callable[[RankInput], np.ndarray],
    model_version: str,
    rng: np.random.Generator,
    on_report: Callable[[FaultReport], None] | None = None,
) -> list[FaultReport]:
    """Each fault in turn, each its own phase; the population carries over (return visits)."""
    reports = []
    for fault in faults:
        report = run_phase(mesh, fault, population, settings, reference, model_version, rng)
        reports.append(report)
        if on_report is not None:
            on_report(report)
    return reports


def render_table(reports: Sequence[FaultReport]) -> str:
    """The per-fault results as a Markdown table."""
    rows = [
        "| fault | sent | succeeded | failed, by status | wrong scores | hung | misses "
        "| fault lasted, s | recovered after, s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        failed = ", ".join(f"{n} {status}" for status, n in sorted(r.failed.items())) or "0"
        recovered = "not within the phase" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        rows.append(
            f"| {r.fault} | {r.sent} | {r.succeeded} | {failed} "
            f"| {r.wrong_scores} of {r.verified} checked | {r.hung} | {r.misses} "
            f"| {r.fault_end_s - r.fault_start_s:.1f} | {recovered} |"
        )
    return "\n".join(rows)
