"""MLPerf LoadGen's Server scenario driving the relay pipeline: one test at one target QPS.

LoadGen decides *when* (its Poisson schedule at the target QPS) and judges the run (latency
percentile against the target, minimum duration and queries, early stopping); the seeded
population decides *who*: the k-th query LoadGen issues is the k-th visit of the population's
open-loop schedule at that QPS, so return visits keep their order and sessions their users
(LoadGen's sample index is not used: a query is a visit, not a dataset sample). A query is the
visit's RetrievalEvent to the trigger at once and its RankRequest to the router one
retrieval-to-ranking gap later (`OpenLoopDriver.visit`); it completes when the Rank answers, so
LoadGen's latency is the gap plus the ranking latency, and the target latency is gap + SLO.

`mlperf_loadgen` (the optional `loadgen` extra, PyPI `mlcommons-loadgen`) is imported only
when a test runs, so the base install works without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from relaygr.behaviours import RankInput
from relaygr.tls_settings import PLAINTEXT, TlsSettings
from tooling.local.drive import OpenLoopDriver, PipelineStubs, RequestRecord, pipeline_stubs
from tooling.local.workload import Arrival

DETAIL_LOG = "mlperf_log_detail.txt"
SUMMARY_LOG = "mlperf_log_summary.txt"
# The target percentile: MLPerf's Server scenarios use the 99th; LoadGen reports these.
PERCENTILE = 0.99
PERCENTILES = (0.9, 0.95, 0.97, 0.99, 0.999)
_MLLOG = ":::MLLOG "


def import_loadgen() -> ModuleType:
    """`mlperf_loadgen`, or SystemExit saying how to install it."""
    try:
        import mlperf_loadgen
    except ImportError as err:
        raise SystemExit(
            "relaygr loadgen needs MLPerf LoadGen: pip install 'relaygr[loadgen]' "
            "(PyPI mlcommons-loadgen)"
        ) from err
    return mlperf_loadgen


@dataclass(frozen=True, slots=True)
class Target:
    """Where the pipeline is: the trigger (None: Ranks only) and the router(s)."""

    trigger: str | None
    router: str
    tls: TlsSettings = PLAINTEXT
    router_options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class ServerTest:
    """One Server-scenario test: `qps` target, latency target `gap_ms + slo_ms` at `percentile`
    (one of PERCENTILES), at least `min_duration_s` and `min_queries` (LoadGen runs until both
    hold)."""

    qps: float
    gap_ms: float
    slo_ms: float
    min_duration_s: float
    min_queries: int
    timeout_s: float  # per-RPC deadline
    seed: int  # LoadGen's schedule seed
    percentile: float = PERCENTILE

    @property
    def target_latency_ns(self) -> int:
        return round((self.gap_ms + self.slo_ms) * 1e6)

    def visits_needed(self) -> int:
        """Visits to prepare: what LoadGen may issue (it is capped at this, `max_query_count`),
        with room for its Poisson schedule to run long."""
        return int(max(self.qps * self.min_duration_s, self.min_queries) * 1.25) + 20


@dataclass(frozen=True, slots=True)
class Verdict:
    """LoadGen's own judgement of a test, read from its detail log."""

    validity: str  # VALID or INVALID
    perf_constraints_met: bool  # the percentile latency within the target
    min_duration_met: bool
    min_queries_met: bool
    early_stopping_met: bool
    early_stopping: str  # LoadGen's early-stopping text
    scheduled_qps: float
    completed_qps: float
    percentile: float  # the target percentile
    latency_ms: float  # LoadGen's latency (gap + ranking) at the target percentile
    p99_ms: float  # and at the 99th
    queries: int
    overlatency: int  # queries over the target latency
    loadgen_version: str

    @property
    def valid(self) -> bool:
        return self.validity == "VALID"

    def text(self) -> str:
        """One line: the verdict and why."""
        met = {
            "latency": self.perf_constraints_met,
            "min duration": self.min_duration_met,
            "min queries": self.min_queries_met,
            "early stopping": self.early_stopping_met,
        }
        unmet = [name for name, ok in met.items() if not ok]
        why = f" (not met: {', '.join(unmet)})" if unmet else ""
        return (
            f"LoadGen: Result is {self.validity}{why}; {self.queries} queries, scheduled "
            f"{self.scheduled_qps:.2f}/s, completed {self.completed_qps:.2f}/s, "
            f"P{self.percentile * 100:g} {self.latency_ms:.0f} ms, {self.overlatency} over target"
        )


def read_detail_log(path: Path) -> dict[str, Any]:
    """Every `:::MLLOG` key of a LoadGen detail log with its (last) value."""
    values: dict[str, Any] = {}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(_MLLOG):
            entry = json.loads(line[len(_MLLOG) :])
            values[entry["key"]] = entry["value"]
    return values


def _latency_ms(values: dict[str, Any], percentile: float) -> float:
    return float(values.get(f"result_{percentile * 100:.2f}_percentile_latency_ns", "nan")) / 1e6


def verdict_of(values: dict[str, Any]) -> Verdict:
    """The verdict in a detail log's values; ValueError when the test did not finish."""
    if "result_validity" not in values:
        raise ValueError("LoadGen's detail log holds no result (did the test finish?)")
    percentile = float(values.get("effective_target_latency_percentile", PERCENTILE))
    return Verdict(
        validity=str(values["result_validity"]),
        perf_constraints_met=bool(values.get("result_perf_constraints_met")),
        min_duration_met=bool(values.get("result_min_duration_met")),
        min_queries_met=bool(values.get("result_min_queries_met")),
        early_stopping_met=bool(values.get("early_stopping_met")),
        early_stopping=" ".join(str(values.get("early_stopping_result", "")).split()),
        scheduled_qps=float(values.get("result_scheduled_samples_per_sec", 0.0)),
        completed_qps=float(values.get("result_completed_samples_per_sec", 0.0)),
        percentile=percentile,
        latency_ms=_latency_ms(values, percentile),
        p99_ms=_latency_ms(values, 0.99),
        queries=int(values.get("result_query_count", 0)),
        overlatency=int(values.get("result_overlatency_query_count", 0)),
        loadgen_version=str(values.get("loadgen_version", "")),
    )


class _Sut:
    """LoadGen's system under test: each query issued becomes the next visit, sent on the
    event loop's thread; the query completes when its Rank is over (answered or failed)."""

    def __init__(
        self,
        lg: ModuleType,
        driver: OpenLoopDriver,
        stubs: PipelineStubs,
        loop: asyncio.AbstractEventLoop,
        visits: int,
    ) -> None:
        self._lg, self._driver, self._stubs, self._loop = lg, driver, stubs, loop
        self._visits = visits
        self.start = time.monotonic()
        self.issued_at: list[float] = []  # per visit: seconds from `start`
        self.records: list[RequestRecord] = []
        self._pending: list[concurrent.futures.Future[None]] = []

    def issue(self, samples: Sequence[Any]) -> None:
        now = time.monotonic()
        for sample in samples:
            i = len(self.issued_at)
            if i >= self._visits:  # LoadGen's max_query_count keeps it from happening
                raise RuntimeError(f"LoadGen issued more than the {self._visits} visits prepared")
            self.issued_at.append(now - self.start)
            visit = self._visit(sample.id, i, now)
            self._pending.append(asyncio.run_coroutine_threadsafe(visit, self._loop))

    def flush(self) -> None:
        """Nothing is batched: every query is sent when issued."""

    async def _visit(self, query_id: int, i: int, arrived: float) -> None:
        completed = False

        def complete(_: RequestRecord | None = None) -> None:
            nonlocal completed
            if not completed:
                completed = True
                self._lg.QuerySamplesComplete([self._lg.QuerySampleResponse(query_id, 0, 0)])

        try:
            record = await self._driver.visit(
                self._stubs, i, arrived, arrived - self.start, on_ranked=complete
            )
            self.records.append(record)
        finally:
            complete()  # LoadGen waits for every query: never leave one open

    async def finished(self) -> list[RequestRecord]:
        """Once LoadGen is done: every visit's record, its event's answer included."""
        await asyncio.gather(*(asyncio.wrap_future(pending) for pending in self._pending))
        return sorted(self.records, key=lambda r: r.index)


@dataclass(slots=True)
class TestRun:
    """What a test left: LoadGen's verdict, the visits it issued and their records."""

    verdict: Verdict
    arrivals: list[Arrival]  # the visits issued, `at` the issue time from the test's start
    records: list[RequestRecord]


def run_server_test(
    target: Target,
    requests: Sequence[RankInput],
    test: ServerTest,
    label: str,
    outdir: Path,
) -> TestRun:
    """Run one Server-scenario test of `requests` (in visit order; at least
    `test.visits_needed()`) against `target`, LoadGen's logs into `outdir`; blocking."""
    lg = import_loadgen()
    visits = min(len(requests), test.visits_needed())
    if visits < test.min_queries:
        raise ValueError(f"{len(requests)} visits prepared, the test needs {test.min_queries}")
    arrivals = [Arrival(0.0, request) for request in requests[:visits]]
    driver = OpenLoopDriver(
        arrivals, label=label, gap_s=test.gap_ms / 1e3, timeout_s=test.timeout_s
    )
    outdir.mkdir(parents=True, exist_ok=True)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="loadgen-sut", daemon=True)
    thread.start()

    def on_loop(coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    stack = AsyncExitStack()
    try:
        stubs = on_loop(stack.enter_async_context(
            pipeline_stubs(target.trigger, target.router, target.tls, target.router_options)
        ))  # fmt: skip
        sut = _Sut(lg, driver, stubs, loop, visits)
        handle = lg.ConstructSUT(sut.issue, sut.flush)
        qsl = lg.ConstructQSL(visits, visits, _no_op, _no_op)
        try:
            lg.StartTestWithLogSettings(handle, qsl, _settings(lg, test, visits), _logs(lg, outdir))
        finally:
            lg.DestroyQSL(qsl)
            lg.DestroySUT(handle)
        records = on_loop(sut.finished())
    finally:
        on_loop(stack.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
    issued = [Arrival(at, arrivals[i].request) for i, at in enumerate(sut.issued_at)]
    return TestRun(verdict_of(read_detail_log(outdir / DETAIL_LOG)), issued, records)


def _no_op(_: Any) -> None:
    """The samples are built before the test: nothing to load or unload."""


def _settings(lg: ModuleType, test: ServerTest, visits: int) -> Any:
    settings = lg.TestSettings()
    settings.scenario = lg.TestScenario.Server
    settings.mode = lg.TestMode.PerformanceOnly
    settings.server_target_qps = test.qps
    settings.server_target_latency_ns = test.target_latency_ns
    settings.server_target_latency_percentile = test.percentile
    settings.min_duration_ms = round(test.min_duration_s * 1e3)
    settings.min_query_count = test.min_queries
    settings.max_query_count = visits
    settings.schedule_rng_seed = test.seed
    return settings


def _logs(lg: ModuleType, outdir: Path) -> Any:
    logs = lg.LogSettings()
    logs.log_output.outdir = str(outdir)
    logs.log_output.copy_summary_to_stdout = False
    logs.enable_trace = False
    return logs
