"""Open-loop driver of the whole pipeline: retrieval event to the trigger, Rank via the router.

Each arrival sends its RetrievalEvent to the trigger at its scheduled time and its RankRequest to
the router `gap_s` later. The schedule is fixed before anything is sent and latency counts from
each Rank's intended send time, so a slow server cannot slow the clock and hide its latency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from relaygr.behaviours import RankInput
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.security import EtcdSecurity
from relaygr.local.mesh import LocalMesh
from relaygr.local.workload import Arrival
from relaygr.tls import open_channel
from relaygr.tls_settings import PLAINTEXT, TlsSettings
from relaygr.v1 import common_pb2, router_pb2_grpc, trigger_pb2, trigger_pb2_grpc
from relaygr.wire import behaviours_to_proto, rank_request_to_proto
from services.trigger.live_config import live_config_key

OUTCOMES = {v: k.removeprefix("CACHE_OUTCOME_").lower() for k, v in common_pb2.CacheOutcome.items()}
REASONS = {
    v: k.removeprefix("ADMISSION_REASON_").lower() for k, v in trigger_pb2.AdmissionReason.items()
}
# Rank outcomes served from a relayed prefix (not by full inference).
HIT_OUTCOMES = frozenset({"hbm_hit", "dram_hit", "waited_inflight", "extended"})


# What a one-behaviour probe (never at risk, never cached) gets back in each trigger mode.
_PROBE_EXPECTED = {
    "off": trigger_pb2.ADMISSION_REASON_RELAY_DISABLED,
    "all": trigger_pb2.ADMISSION_REASON_ADMITTED,
    "sequence-aware": trigger_pb2.ADMISSION_REASON_NOT_AT_RISK,
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
            if (await stub.OnRetrieval(event, timeout=5)).reason == _PROBE_EXPECTED[mode]:
                return
            await asyncio.sleep(0.05)  # poll interval under a deadline
    raise TimeoutError(f"trigger did not switch to mode {mode}")


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

    def summary(self) -> dict[str, object]:
        """Everything but the raw latencies (for result files)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "latencies_ms"}

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
) -> Point:
    """Run `arrivals` through the pipeline (no trigger call when `trigger_address` is None).

    A failed or late OnRetrieval never holds back the Rank: the ranking path goes on without it.
    `on_done` is called after each Rank (for a progress bar). `tls`: how to dial the services.
    """
    latencies: list[float] = []
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    relayed_tokens = 0
    relayed = 0
    # Protos are built before the clock starts: building them must not delay a send.
    events = [retrieval_event(a.request, f"{label}-{i}") for i, a in enumerate(arrivals)]
    ranks = [rank_request_to_proto(a.request) for a in arrivals]
    async with (
        open_channel(router_address, tls) as router_channel,
        open_channel(trigger_address or router_address, tls) as trigger_channel,
    ):
        router = router_pb2_grpc.RouterServiceStub(router_channel)
        trigger = trigger_pb2_grpc.TriggerServiceStub(trigger_channel)
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.5

        async def decide(i: int, counted: bool) -> None:
            nonlocal relayed_tokens
            try:
                decision = await trigger.OnRetrieval(events[i], timeout=timeout_s)
            except grpc.aio.AioRpcError as err:
                if counted:
                    reasons[f"error_{err.code().name}"] += 1
                return
            if counted:
                reasons[REASONS[decision.reason]] += 1
                if decision.admitted:
                    relayed_tokens += arrivals[i].request.prefix.num_tokens

        async def one(i: int) -> None:
            nonlocal relayed
            at = arrivals[i].at
            counted = at >= warmup_s
            pending: asyncio.Task[None] | None = None
            if trigger_address is not None:
                await asyncio.sleep(max(0.0, start + at - loop.time()))
                pending = asyncio.create_task(decide(i, counted))
            intended = start + at + gap_s
            await asyncio.sleep(max(0.0, intended - loop.time()))
            try:
                reply = await router.Rank(ranks[i], timeout=timeout_s)
            except grpc.aio.AioRpcError as err:
                if counted:
                    errors[err.code().name] += 1
            else:
                if counted:
                    latencies.append((loop.time() - intended) * 1e3)
                    outcome = OUTCOMES[reply.cache_outcome]
                    outcomes[outcome] += 1
                    relayed += reply.relayed and outcome in HIT_OUTCOMES
            if on_done is not None:
                on_done()
            if pending is not None:
                await pending

        await asyncio.gather(*(one(i) for i in range(len(arrivals))))
    counted = [a for a in arrivals if a.at >= warmup_s]
    point = Point(label, rate, len(counted), len(latencies), dict(errors))
    if latencies:
        point.p50_ms = float(np.percentile(latencies, 50))
        point.p95_ms = float(np.percentile(latencies, 95))
        point.p99_ms = float(np.percentile(latencies, 99))
    point.outcomes, point.reasons = dict(outcomes), dict(reasons)
    point.relayed = relayed
    point.relayed_tokens = relayed_tokens
    point.latencies_ms = latencies
    point.duration_s = (arrivals[-1].at - warmup_s) if counted else 0.0
    return point


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
) -> Point:
    """Put `mesh`'s trigger in `mode`, then drive `arrivals` through its trigger and router
    (blocking; the demo's and the mesh benchmarks' one point)."""
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
        )
    )
