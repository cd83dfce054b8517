"""Open-loop driver of the whole pipeline: retrieval event to the trigger, Rank via the router.

Each arrival sends its RetrievalEvent to the trigger at its scheduled time and its RankRequest to
the router `gap_s` later. The schedule is fixed before anything is sent and latency counts from
each Rank's intended send time, so a slow server cannot slow the clock and hide its latency.
Every request sent is recorded (`RequestRecord`); `Point` sums a run's records up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc
import numpy as np

from relaygr.behaviours import RankInput
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.security import EtcdSecurity
from relaygr.tls import ChannelOption, open_channel
from relaygr.tls_settings import PLAINTEXT, TlsSettings
from relaygr.v1 import common_pb2, router_pb2_grpc, trigger_pb2, trigger_pb2_grpc
from relaygr.wire import behaviours_to_proto, rank_request_to_proto
from services.trigger.live_config import live_config_key
from tooling.local.mesh import LocalMesh
from tooling.local.workload import Arrival, Follow, check_follow

OUTCOMES = {v: k.removeprefix("CACHE_OUTCOME_").lower() for k, v in common_pb2.CacheOutcome.items()}
REASONS = {
    v: k.removeprefix("ADMISSION_REASON_").lower() for k, v in trigger_pb2.AdmissionReason.items()
}
# Rank outcomes served from a relayed prefix (not by full inference).
HIT_OUTCOMES = frozenset({"hbm_hit", "dram_hit", "waited_inflight", "extended", "peer_fetched"})
# The status of a call with no answer `hang_grace_s` past its deadline.
HUNG = "HUNG"
OK = "OK"
# The status of a retrieval never followed by a Rank (a no-show): not a Rank sent, not counted.
NO_RANK = "NO_RANK"

_Reply = TypeVar("_Reply")


# What a one-behaviour probe (never at risk, never cached) gets back in each trigger mode.
_PROBE_EXPECTED = {
    "off": {trigger_pb2.ADMISSION_REASON_RELAY_DISABLED},
    "all": {trigger_pb2.ADMISSION_REASON_ADMITTED},
    # A one-behaviour probe is never at risk: refused, or relayed into spare room.
    "sequence-aware": {
        trigger_pb2.ADMISSION_REASON_NOT_AT_RISK,
        trigger_pb2.ADMISSION_REASON_SPARE,
    },
}


async def set_trigger_mode(
    etcd_endpoint: str,
    trigger_address: str,
    mode: str,
    etcd_prefix: str = "/relaygr",
    timeout_s: float = 30.0,
    *,
    tls: TlsSettings = PLAINTEXT,
    etcd_security: EtcdSecurity | None = None,
) -> None:
    """Switch the trigger's mode through its live config; return once it answers in it.

    `tls` and `etcd_security` are how to reach the trigger and etcd (LocalMesh.client_tls and
    LocalMesh.etcd_security for a local mesh)."""
    client = EtcdClient([etcd_endpoint], security=etcd_security)
    try:
        await client.put(live_config_key(etcd_prefix), json.dumps({"mode": mode}).encode())
    finally:
        await client.close()
    deadline = time.monotonic() + timeout_s
    async with open_channel(trigger_address, tls) as channel:
        stub = trigger_pb2_grpc.TriggerServiceStub(channel)
        probe = 0
        while time.monotonic() < deadline:
            probe += 1
            event = trigger_pb2.RetrievalEvent(
                user_id=f"probe-{mode}-{probe}",
                long_term=common_pb2.Behaviours(item_ids=[1], actions=[0], timestamps=[1]),
                expected_candidates=1,
            )
            if (await stub.OnRetrieval(event, timeout=5)).reason in _PROBE_EXPECTED[mode]:
                return
            await asyncio.sleep(0.05)  # poll interval under a deadline
    raise TimeoutError(f"trigger did not switch to mode {mode}")


class Scheduled(Protocol):
    """An arrival as a run's sums see it (`Arrival`, or the simulator's `Visit`)."""

    @property
    def at(self) -> float: ...

    @property
    def prefix_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One sent arrival: its Rank, and its retrieval event when the driver had a trigger.

    Times are seconds from the schedule's start. `status` is "OK", a gRPC status name or HUNG;
    the reply's fields are set only when it is "OK". `relayed` is set only on a hit.
    """

    index: int  # the arrival's position in the schedule
    at: float  # the Rank's intended send time: the arrival's time + gap
    latency_s: float  # from the intended send time to the answer or the failure
    status: str
    outcome: str = ""  # cache outcome of an answered Rank
    instance: str = ""  # the ranker that served it
    model_version: str = ""
    scores: np.ndarray | None = field(default=None, repr=False)  # kept when the driver is asked
    relayed: bool = False  # a hit whose prefix a PreInfer produced or pinned (RankReply.relayed)
    decision_status: str = ""  # the OnRetrieval's status as `status`; "" when none was sent
    decision: str = ""  # the trigger's admission reason, when it answered
    admitted: bool = False  # the trigger relays this arrival's prefix
    server_ms: float = 0.0  # the ranker's own time for an answered Rank (RankReply.server_ms)

    @property
    def hit(self) -> bool:
        """Served from a cached prefix, not by full inference."""
        return self.status == OK and self.outcome in HIT_OUTCOMES

    @property
    def cached(self) -> bool:
        """A hit on a prefix an earlier visit left (cross-visit), not a relayed one."""
        return self.hit and not self.relayed


@dataclass(slots=True)
class Point:
    """What one open-loop run measured (requests before `warmup_s` are not counted)."""

    label: str
    rate: float
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    p50_ms: float = float("inf")
    p95_ms: float = float("inf")
    p99_ms: float = float("inf")
    outcomes: dict[str, int] = field(default_factory=dict)  # Rank cache outcomes
    relayed: int = 0  # hits whose prefix a PreInfer produced or pinned (RankReply.relayed)
    reasons: dict[str, int] = field(default_factory=dict)  # trigger decisions
    relayed_tokens: int = 0  # prefix tokens of admitted relays
    duration_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list, repr=False)

    @classmethod
    def of(
        cls,
        label: str,
        rate: float,
        arrivals: Sequence[Scheduled],
        records: Sequence[RequestRecord],
        warmup_s: float,
    ) -> Point:
        """The sums of a run's `records` over the arrivals from `warmup_s` on."""
        after = [r for r in records if arrivals[r.index].at >= warmup_s]
        counted = [r for r in after if r.status != NO_RANK]  # Ranks sent
        answered = [r for r in counted if r.status == OK]
        latencies = [r.latency_s * 1e3 for r in answered]
        reasons: Counter[str] = Counter()
        for r in after:  # every retrieval's decision, ranked or not
            if r.decision_status == OK:
                reasons[r.decision] += 1
            elif r.decision_status:
                reasons[f"error_{r.decision_status}"] += 1
        point = cls(
            label,
            rate,
            sent=len(counted),
            ok=len(answered),
            errors=dict(Counter(r.status for r in counted if r.status != OK)),
            outcomes=dict(Counter(r.outcome for r in answered)),
            relayed=sum(r.relayed for r in answered),
            reasons=dict(reasons),
            relayed_tokens=sum(arrivals[r.index].prefix_tokens for r in after if r.admitted),
            duration_s=(arrivals[-1].at - warmup_s) if after else 0.0,
            latencies_ms=latencies,
        )
        if latencies:
            point.p50_ms = float(np.percentile(latencies, 50))
            point.p95_ms = float(np.percentile(latencies, 95))
            point.p99_ms = float(np.percentile(latencies, 99))
        return point

    def summary(self, latencies: bool = True) -> dict[str, object]:
        """What a result file keeps of the point: its sums and, unless `latencies` is false, every
        counted Rank's latency rounded to 0.01 ms (so that P99 and its interval can be recomputed
        from the file; rounding moves a P99 by at most 0.005 ms). `Point(**summary)` rebuilds it.
        """
        kept = dataclasses.asdict(self)
        kept["latencies_ms"] = [round(v, 2) for v in self.latencies_ms] if latencies else []
        return kept

    def within_slo_per_s(self, slo_ms: float) -> float:
        """Throughput of Ranks that met the SLO, counted over the measured span."""
        met = sum(latency <= slo_ms for latency in self.latencies_ms)
        return met / self.duration_s if self.duration_s > 0 else 0.0

    def compliant(self, slo_ms: float) -> bool:
        """P99 within the SLO and no failed request."""
        return not self.errors and self.p99_ms <= slo_ms

    @property
    def hits(self) -> int:
        return sum(v for k, v in self.outcomes.items() if k in HIT_OUTCOMES)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.ok if self.ok else 0.0

    @property
    def relayed_ratio(self) -> float:
        """Share of answered Ranks served from a relayed prefix."""
        return self.relayed / self.ok if self.ok else 0.0

    @property
    def cached_ratio(self) -> float:
        """Share of answered Ranks served from a prefix an earlier visit left (cross-visit)."""
        return (self.hits - self.relayed) / self.ok if self.ok else 0.0


def retrieval_event(request: RankInput, request_id: str) -> trigger_pb2.RetrievalEvent:
    p = request.prefix
    return trigger_pb2.RetrievalEvent(
        request_id=request_id,
        user_id=p.user_id,
        user_features=p.user_features.tolist(),
        long_term=behaviours_to_proto(p.long_term),
        expected_candidates=len(request.candidates),
        expected_short_term=len(request.short_term),
        request_ts=request.request_ts,
    )


@dataclass(frozen=True, slots=True)
class PipelineStubs:
    """Open channels to a mesh's router (or routers) and, when there is one, its trigger."""

    router: router_pb2_grpc.RouterServiceStub
    trigger: trigger_pb2_grpc.TriggerServiceStub | None


@asynccontextmanager
async def pipeline_stubs(
    trigger_address: str | None,
    router_target: str,
    tls: TlsSettings = PLAINTEXT,
    router_options: Sequence[ChannelOption] = (),
) -> AsyncIterator[PipelineStubs]:
    """Stubs on channels open for the block (no trigger when `trigger_address` is None)."""
    async with AsyncExitStack() as stack:
        channel = await stack.enter_async_context(open_channel(router_target, tls, router_options))
        router = router_pb2_grpc.RouterServiceStub(channel)
        trigger = None
        if trigger_address is not None:
            channel = await stack.enter_async_context(open_channel(trigger_address, tls))
            trigger = trigger_pb2_grpc.TriggerServiceStub(channel)
        yield PipelineStubs(router, trigger)


class OpenLoopDriver:
    """Sends a schedule of arrivals, fixed before the first send, and records every request.

    Arrival i's RetrievalEvent (request id "<label>-i") goes to the trigger at its time, its
    RankRequest to the router `gap_s` later, whatever the earlier requests are doing; a failed
    or late OnRetrieval never holds the Rank back. Every call has deadline `timeout_s`; one
    unanswered `hang_grace_s` past it is abandoned as HUNG. Each sent arrival gets one record,
    appended once both its calls are over. `stop_after` (seconds from the start; may be set
    from another thread) ends the schedule: arrivals after it are not sent. `follow`
    (`tooling.local.workload.follow_ups`), when given, sets each arrival's own gap and whether
    a Rank follows at all: a no-show sends its RetrievalEvent only, and is recorded NO_RANK.
    """

    def __init__(
        self,
        arrivals: Sequence[Arrival],
        *,
        label: str,
        gap_s: float,
        timeout_s: float,
        hang_grace_s: float = 2.0,
        keep_scores: bool = False,
        follow: Follow | None = None,
    ) -> None:
        self._arrivals = arrivals
        n = len(arrivals)
        if follow is not None:
            check_follow(follow, n)
        self._gaps = [gap_s] * n if follow is None else [float(g) for g in follow[0]]
        self._ranked = [True] * n if follow is None else [bool(r) for r in follow[1]]
        self._timeout_s = timeout_s
        self._hang_after_s = timeout_s + hang_grace_s
        self._keep_scores = keep_scores
        # Protos are built before the clock starts: building them must not delay a send.
        self._events = [retrieval_event(a.request, f"{label}-{i}") for i, a in enumerate(arrivals)]
        self._ranks = [rank_request_to_proto(a.request) for a in arrivals]
        self.stop_after: float | None = None

    async def run(
        self,
        trigger_address: str | None,
        router_target: str,
        *,
        tls: TlsSettings = PLAINTEXT,
        router_options: Sequence[ChannelOption] = (),
        start: float | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> list[RequestRecord]:
        """Send the schedule (no trigger call when `trigger_address` is None) from `start` (a
        `time.monotonic()` reading; default half a second from now, for the channels to open)
        and return the records. `on_done` is called after each Rank (for a progress bar)."""
        start = time.monotonic() + 0.5 if start is None else start
        records: list[RequestRecord] = []
        on_ranked = (lambda _: on_done()) if on_done is not None else None
        async with pipeline_stubs(trigger_address, router_target, tls, router_options) as stubs:

            async def one(i: int) -> None:
                at = self._arrivals[i].at
                records.append(await self.visit(stubs, i, start + at, at, on_ranked=on_ranked))

            tasks: list[asyncio.Task[None]] = []
            for i, arrival in enumerate(self._arrivals):
                await asyncio.sleep(max(0.0, start + arrival.at - time.monotonic()))
                if self.stop_after is not None and arrival.at > self.stop_after:
                    break
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        return records

    async def visit(
        self,
        stubs: PipelineStubs,
        i: int,
        arrived: float,
        at: float,
        *,
        on_ranked: Callable[[RequestRecord], None] | None = None,
    ) -> RequestRecord:
        """Arrival i's visit: its RetrievalEvent now (when `stubs` has a trigger), its Rank its
        gap after `arrived` (a `time.monotonic()` reading), whatever the event is doing; a
        no-show sends no Rank and is recorded NO_RANK.

        `at` is when it arrived in seconds from the schedule's start (the record's `at` is the
        Rank's intended send time, `at` plus its gap; its latency counts from then). `on_ranked`
        is called with the record as soon as the Rank is over, before the event's answer is
        in."""
        decision = None
        if stubs.trigger is not None:
            decision = asyncio.create_task(
                self._call(stubs.trigger.OnRetrieval(self._events[i], timeout=self._timeout_s))
            )
        gap_s = self._gaps[i]
        if self._ranked[i]:
            due = arrived + gap_s
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            rank = stubs.router.Rank(self._ranks[i], timeout=self._timeout_s)
            reply, status = await self._call(rank)
            record = RequestRecord(i, at + gap_s, time.monotonic() - due, status)
            if reply is not None:
                record = self._answered(record, reply)
            if on_ranked is not None:
                on_ranked(record)
        else:  # a no-show: filtered or abandoned after its retrieval
            record = RequestRecord(i, at + gap_s, 0.0, NO_RANK)
        if decision is not None:
            answer, decision_status = await decision
            record = dataclasses.replace(
                record,
                decision_status=decision_status,
                decision=REASONS[answer.reason] if answer is not None else "",
                admitted=answer is not None and answer.admitted,
            )
        return record

    async def _call(self, call: Awaitable[_Reply]) -> tuple[_Reply | None, str]:
        """(reply, "OK"), or (None, the failure's status or HUNG)."""
        try:
            return await asyncio.wait_for(call, self._hang_after_s), OK
        except grpc.aio.AioRpcError as err:
            return None, err.code().name
        except TimeoutError:
            return None, HUNG

    def _answered(self, record: RequestRecord, reply: common_pb2.RankReply) -> RequestRecord:
        outcome = OUTCOMES[reply.cache_outcome]
        scores = None
        if self._keep_scores:
            scores = np.array([list(t.scores) for t in reply.scores], dtype=np.float32)
        return dataclasses.replace(
            record,
            outcome=outcome,
            instance=reply.instance_id,
            model_version=reply.model_version,
            scores=scores,
            relayed=reply.relayed and outcome in HIT_OUTCOMES,
            server_ms=reply.server_ms,
        )


async def drive(
    trigger_address: str | None,
    router_address: str,
    arrivals: Sequence[Arrival],
    *,
    label: str,
    rate: float,
    gap_s: float,
    warmup_s: float,
    timeout_s: float,
    on_done: Callable[[], None] | None = None,
    tls: TlsSettings = PLAINTEXT,
    records: list[RequestRecord] | None = None,
    follow: Follow | None = None,
) -> Point:
    """Run `arrivals` through the pipeline with an `OpenLoopDriver` (no trigger call when
    `trigger_address` is None) and sum its records up.

    `on_done` is called after each Rank (for a progress bar). `tls`: how to dial the services.
    `records`: when given, every record of the run (warm-up included) is appended to it.
    `follow`: each arrival's gap and whether it is ranked (`OpenLoopDriver`).
    """
    driver = OpenLoopDriver(arrivals, label=label, gap_s=gap_s, timeout_s=timeout_s, follow=follow)
    ran = await driver.run(trigger_address, router_address, tls=tls, on_done=on_done)
    if records is not None:
        records.extend(sorted(ran, key=lambda r: r.index))
    return Point.of(label, rate, arrivals, ran, warmup_s)


def drive_mesh(
    mesh: LocalMesh,
    mode: str,
    arrivals: Sequence[Arrival],
    *,
    label: str,
    rate: float,
    gap_s: float,
    warmup_s: float,
    timeout_s: float,
    on_done: Callable[[], None] | None = None,
    records: list[RequestRecord] | None = None,
    follow: Follow | None = None,
) -> Point:
    """Put `mesh`'s trigger in `mode`, then drive `arrivals` through its trigger and router
    (blocking; the demo's and the mesh benchmarks' one point). `records`, `follow`: as
    `drive`'s."""
    if mesh.trigger is None or mesh.router is None:
        raise ValueError("drive_mesh needs a started mesh with a trigger and a router")
    asyncio.run(
        set_trigger_mode(
            mesh.etcd_endpoint,
            mesh.trigger.address,
            mode,
            tls=mesh.client_tls,
            etcd_security=mesh.etcd_security,
        )
    )
    return asyncio.run(
        drive(
            mesh.trigger.address,
            mesh.router_target,
            arrivals,
            label=label,
            rate=rate,
            gap_s=gap_s,
            warmup_s=warmup_s,
            timeout_s=timeout_s,
            on_done=on_done,
            tls=mesh.client_tls,
            records=records,
            follow=follow,
        )
    )
