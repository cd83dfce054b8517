"""Traces, metrics and logs of a real trigger -> router -> ranker mesh on loopback.

Each in-process service gets its own tracer provider (built from an OTEL_* environment, as a
process would), exporting to a real OTLP/gRPC receiver; nothing touches the process-global
provider, so the services keep their own `service.name` and tests do not leak into each other.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import grpc
import numpy as np
import pytest
from opentelemetry import trace
from prometheus_client.parser import text_string_to_metric_families

from relaygr.behaviours import Prefix
from relaygr.telemetry import Telemetry
from relaygr.v1 import common_pb2, ranker_pb2_grpc, router_pb2_grpc, trigger_pb2, trigger_pb2_grpc
from relaygr.wire import (
    behaviours_to_proto,
    pre_infer_request_to_proto,
    rank_request_to_proto,
)
from services.ranker.queues import Priority
from services.ranker.server import start_ranker
from tests.integration.etcd_server import EtcdServer
from tests.integration.mesh_harness import Mesh, running_mesh
from tests.integration.otlp_receiver import CLIENT, INTERNAL, SERVER, OtlpReceiver, ReceivedSpan
from tests.integration.process_mesh import free_ports, tiny_mesh
from tests.integration.ranker_harness import BASE, COST, Gate, Ranker, tiny_model
from tests.integration.test_ranker_process import wait_for_port
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input
from tooling.local.drive import retrieval_event
from tooling.local.mesh import LocalMesh
from tooling.local.scrape import scrape

# The harness's cost model predicts full inference of a 700-token history with 16 candidates at
# ~9 ms and of a 30-token one at ~1.5 ms: an 8 ms SLO with 1 ms margin relays only the first.
SLO = {"slo_ms": 8.0, "margin_ms": 1.0}
LONG, SHORT = 700, 30
SERVICES = ("relaygr-trigger", "relaygr-router", "relaygr-ranker")


def _event(p: Prefix) -> trigger_pb2.RetrievalEvent:
    return trigger_pb2.RetrievalEvent(
        request_id=f"req-{p.user_id}",
        user_id=p.user_id,
        user_features=p.user_features.tolist(),
        long_term=behaviours_to_proto(p.long_term),
        expected_candidates=16,
        expected_short_term=16,
        request_ts=1_700_000_000,
    )


@asynccontextmanager
async def observed_mesh(
    etcd: str, env: Mapping[str, str], serve_metrics: bool = False, **trigger: Any
) -> AsyncIterator[Mesh]:
    """One ranker ("r0"), a router and a trigger, each with telemetry from `env`.

    Generous relay window and lease: the machine may be shared with other heavy work, and a
    slow PreInfer or a late keepalive would otherwise fail the relay these tests follow.
    """
    async with running_mesh(
        etcd, tiny_model(), telemetry_env=env, serve_metrics=serve_metrics
    ) as mesh:
        await mesh.add_ranker("r0", lease_ttl_s=10.0)
        await mesh.add_router()
        await mesh.add_trigger(**{"relay_window_ms": 20_000, **trigger})
        yield mesh


def one(spans: list[ReceivedSpan], **want: object) -> ReceivedSpan:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in want.items())]
    assert len(found) == 1, (
        f"{len(found)} spans match {want}: {[(s.service, s.name) for s in found]}"
    )
    return found[0]


async def test_a_relay_is_two_traces_linked_at_the_ranker(
    etcd_server: EtcdServer, otlp_receiver: OtlpReceiver, rng: np.random.Generator
) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint}
    user = prefix(rng, LONG, user_id="relayed-user")

    async with observed_mesh(etcd_server.endpoint, env, mode="all") as mesh:
        decision = await mesh.trigger_stubs[0].OnRetrieval(_event(user))
        assert decision.admitted and decision.target_instance == "r0"
        servicer = mesh.triggers[0].servicer
        await eventually(lambda: servicer.stats.relayed == 1, "relay landed", 60)
        request = rank_request_to_proto(rank_input(rng, user, n_short=16, n_candidates=16))
        reply = await mesh.stubs[0].Rank(request)
        assert reply.cache_outcome == common_pb2.CACHE_OUTCOME_HBM_HIT

        async def exported() -> bool:
            await mesh.flush()
            names = {(s.service, s.name, s.kind) for s in otlp_receiver.spans()}
            return {
                ("relaygr-ranker", "/relaygr.v1.RankerService/Rank", SERVER),
                ("relaygr-router", "/relaygr.v1.RouterService/Rank", SERVER),
                ("relaygr-trigger", "/relaygr.v1.RouterService/PreInfer", CLIENT),
                ("relaygr-ranker", "/relaygr.v1.RankerService/Describe", SERVER),
            } <= names

        await eventually(exported, "spans of both requests exported", 60)
    spans = otlp_receiver.spans()
    assert {s.service for s in spans} == set(SERVICES)

    # The retrieval request: one trace from the trigger through the router to the ranker.
    on_retrieval = one(spans, name="/relaygr.v1.TriggerService/OnRetrieval", kind=SERVER)
    retrieval = [s for s in spans if s.trace_id == on_retrieval.trace_id]
    by_id = {s.span_id: s for s in retrieval}
    decide = one(retrieval, name="trigger.decide")
    assert decide.parent_id == on_retrieval.span_id and decide.kind == INTERNAL
    assert decide.attributes["relaygr.admission.reason"] == "admitted"
    assert decide.attributes["relaygr.admission.target"] == "r0"
    assert decide.attributes["relaygr.admission.predicted_full_ms"] > 0
    assert decide.attributes["relaygr.relay.window_ms"] == 20_000  # the pin it asks for
    trigger_call = one(retrieval, service="relaygr-trigger", kind=CLIENT)
    assert trigger_call.parent_id == decide.span_id  # sent later, from the dispatch queue
    router_in = one(retrieval, service="relaygr-router", kind=SERVER)
    assert router_in.name == "/relaygr.v1.RouterService/PreInfer"
    assert router_in.parent_id == trigger_call.span_id
    route = one(retrieval, service="relaygr-router", name="router.route")
    assert route.parent_id == router_in.span_id
    assert route.attributes["relaygr.placement.reason"] == "hash"
    assert route.attributes["relaygr.placement.instance"] == "r0"
    assert route.attributes["relaygr.placement.attempts"] == 1
    router_out = one(retrieval, service="relaygr-router", kind=CLIENT)
    assert router_out.parent_id == route.span_id
    pre_infer = one(retrieval, service="relaygr-ranker", kind=SERVER)
    assert pre_infer.name == "/relaygr.v1.RankerService/PreInfer"
    assert pre_infer.parent_id == router_out.span_id
    assert pre_infer.attributes["relaygr.pre_infer.outcome"] == "computed"
    assert pre_infer.attributes["relaygr.tokens.prefix"] == user.num_tokens
    assert pre_infer.attributes["relaygr.relay.window_ms"] == 20_000  # pinned as the trigger asked
    prefill = one(retrieval, name="ranker.prefill")
    assert prefill.parent_id == pre_infer.span_id
    assert prefill.attributes["relaygr.tokens.computed"] == user.num_tokens
    assert prefill.attributes["relaygr.kv.bytes"] > 0
    queue = one(retrieval, name="ranker.queue")
    assert queue.parent_id == pre_infer.span_id
    assert queue.attributes["relaygr.priority"] == "background"
    for span in retrieval:  # every span of the trace hangs off the trigger's server span
        while span.parent_id:
            span = by_id[span.parent_id]
        assert span is on_retrieval

    # The ranking request: its own trace, whose Rank links back to the PreInfer span.
    router_rank = one(spans, name="/relaygr.v1.RouterService/Rank", kind=SERVER)
    assert router_rank.trace_id != on_retrieval.trace_id and router_rank.parent_id == ""
    ranking = [s for s in spans if s.trace_id == router_rank.trace_id]
    rank = one(ranking, service="relaygr-ranker", kind=SERVER)
    assert rank.name == "/relaygr.v1.RankerService/Rank"
    rank_route = one(ranking, name="router.route")
    assert rank_route.parent_id == router_rank.span_id
    assert rank.parent_id == one(ranking, service="relaygr-router", kind=CLIENT).span_id
    assert rank.attributes["relaygr.cache.outcome"] == "hbm_hit"
    assert rank.attributes["relaygr.tokens.computed"] == 16 + 16
    [link] = rank.links
    assert (link.trace_id, link.span_id) == (pre_infer.trace_id, pre_infer.span_id)
    assert link.attributes["relaygr.relay.producer"] == "pre_infer"
    compute = one(ranking, name="ranker.rank")
    assert compute.parent_id == rank.span_id
    assert one(ranking, name="ranker.queue").attributes["relaygr.priority"] == "rank"

    # The trigger's and (since issue 16) the router's Describe polling carry context too: a
    # round is one trace of its own.
    describe = [
        s for s in spans if s.name == "/relaygr.v1.RankerService/Describe" and s.kind == SERVER
    ]
    rounds = ("trigger.observe", "router.observe")
    observe = {s.span_id: s for s in spans if s.name in rounds}
    assert {s.name for s in observe.values()} == set(rounds)
    pollers = ("relaygr-trigger", "relaygr-router")
    calls = {s.span_id: s for s in spans if s.service in pollers and s.kind == CLIENT}
    assert describe and all(calls[s.parent_id].parent_id in observe for s in describe)
    # Health checks are never traced.
    assert not [s for s in spans if "grpc.health" in s.name]


def _scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        text: str = reply.read().decode()
        return text


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples_now(port: int | None) -> Samples:
    """Every sample of a service's /metrics, by name and labels."""
    assert port is not None
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    return {(sample.name, frozenset(sample.labels.items())): sample.value for sample in samples}


async def _samples(port: int | None) -> Samples:
    """The samples of a service's /metrics (fetched off the loop that serves them)."""
    return await asyncio.to_thread(_samples_now, port)


def _value(samples: Mapping[Any, float], name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


async def test_metrics_move_with_a_known_sequence(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    """Two relayed users and one short one: admissions, placements, hits and misses counted."""
    longs = [prefix(rng, LONG, user_id=f"long{i}") for i in range(2)]
    short = prefix(rng, SHORT, user_id="short0")

    # Only what is at risk is relayed (no spare-room relay of the short one).
    at_risk_only = {**SLO, "relay_spare_share": 0.0}
    async with observed_mesh(etcd_server.endpoint, {}, serve_metrics=True, **at_risk_only) as mesh:
        before = await _samples(mesh.rankers["r0"].metrics_port)
        assert (
            _value(before, "relaygr_ranker_rank_latency_seconds_count", cache_outcome="miss") == 0
        )
        for p in [*longs, short]:
            await mesh.trigger_stubs[0].OnRetrieval(_event(p))
        servicer = mesh.triggers[0].servicer
        await eventually(lambda: servicer.stats.relayed == 2, "relays landed", 60)
        again = await mesh.trigger_stubs[0].OnRetrieval(_event(longs[0]))
        assert again.reason == trigger_pb2.ADMISSION_REASON_ALREADY_CACHED
        outcomes = []
        for p in [*longs, short, short]:
            request = rank_request_to_proto(rank_input(rng, p, n_short=8, n_candidates=8))
            outcomes.append((await mesh.stubs[0].Rank(request)).cache_outcome)
        hit, miss = common_pb2.CACHE_OUTCOME_HBM_HIT, common_pb2.CACHE_OUTCOME_MISS
        assert outcomes == [hit, hit, miss, hit]  # the miss left its prefix cached

        trigger = await _samples(mesh.triggers[0].metrics_port)
        admissions = "relaygr_trigger_admissions_total"
        assert _value(trigger, admissions, reason="admitted") == 2
        assert _value(trigger, admissions, reason="not_at_risk") == 1
        assert _value(trigger, admissions, reason="already_cached") == 1
        assert _value(trigger, admissions, reason="load_limit") == 0
        assert _value(trigger, "relaygr_trigger_dispatches_total", outcome="relayed") == 2
        assert _value(trigger, "relaygr_trigger_dispatches_total", outcome="failed") == 0
        assert _value(trigger, "relaygr_trigger_dispatch_queue_depth") == 0
        assert _value(trigger, "relaygr_trigger_slo_seconds") == SLO["slo_ms"] / 1e3
        assert 0 < _value(trigger, "relaygr_trigger_no_show_share") <= 1  # none seen: the prior 1
        assert _value(trigger, "relaygr_cluster_rankers") == 1
        assert _value(trigger, "relaygr_etcd_connected") == 1

        router = await _samples(mesh.routers[0].metrics_port)
        placements = "relaygr_router_placements_total"
        assert _value(router, placements, method="PreInfer", reason="hash") == 2
        assert _value(router, placements, method="PreInfer", reason="spilled") == 0
        assert _value(router, placements, method="Rank", reason="hash") == 4
        forwarded = "relaygr_router_forwarded_total"
        assert _value(router, forwarded, method="PreInfer", code="OK") == 2
        assert _value(router, forwarded, method="Rank", code="OK") == 4
        assert _value(router, "relaygr_router_failovers_total", method="Rank") == 0
        assert _value(router, "relaygr_router_ranker_load", instance="r0") == 2
        assert _value(router, "relaygr_etcd_connected") == 1

        ranker = await _samples(mesh.rankers["r0"].metrics_port)
        latency = "relaygr_ranker_rank_latency_seconds_count"
        assert _value(ranker, latency, cache_outcome="hbm_hit") == 3
        assert _value(ranker, latency, cache_outcome="miss") == 1
        assert _value(ranker, latency, cache_outcome="dram_hit") == 0
        assert _value(ranker, "relaygr_ranker_cache_hit_ratio", tier="hbm") == 0.75
        assert _value(ranker, "relaygr_ranker_cache_hit_ratio", tier="dram") == 0
        pre_infers = "relaygr_ranker_pre_infer_latency_seconds_count"
        assert _value(ranker, pre_infers, outcome="computed") == 2
        assert _value(ranker, "relaygr_ranker_relays_consumed_total") == 2
        assert _value(ranker, "relaygr_ranker_relays_unconsumed_total", reason="expired") == 0
        assert _value(ranker, "relaygr_ranker_kv_entries", tier="hbm") == 3
        assert _value(ranker, "relaygr_ranker_kv_stored_total", tier="hbm") == 3
        assert _value(ranker, "relaygr_ranker_kv_used_bytes", tier="hbm") > 0
        assert _value(ranker, "relaygr_ranker_kv_pinned_bytes", tier="hbm") == 0
        drops = "relaygr_ranker_kv_drops_total"
        assert _value(ranker, drops, tier="hbm", reason="demoted") == 0
        assert _value(ranker, "relaygr_ranker_queue_depth", priority="rank") == 0
        assert _value(ranker, "relaygr_ranker_inflight_prefixes") == 0
        assert _value(ranker, "relaygr_ranker_queued_prefill_seconds") == 0
        assert _value(ranker, "relaygr_etcd_connected") == 1
        assert _value(ranker, "process_cpu_seconds_total") > 0  # the standard process set

        port = mesh.rankers["r0"].metrics_port
        with pytest.raises(urllib.error.HTTPError, match="404"):
            await asyncio.to_thread(_scrape, port, "/nothing")  # type: ignore[arg-type]


def _exporter_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("OtelBatch")]


@pytest.mark.parametrize(
    "disable",
    [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}, {"endpoint": "unset"}],
    ids=["sdk-disabled", "exporter-none", "no-endpoint"],
)
async def test_tracing_off_creates_no_exporter_and_sends_nothing(
    otlp_receiver: OtlpReceiver, rng: np.random.Generator, disable: dict[str, str]
) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint, **disable}
    if disable.get("endpoint") == "unset":
        env = {"OTEL_SERVICE_NAME": "relaygr-ranker"}
    telemetry = Telemetry.from_env("relaygr-ranker", env)
    assert telemetry.tracer_provider is None and telemetry.server_interceptors() == []

    server = await start_ranker(BASE, model=tiny_model(), cost_model=COST, telemetry=telemetry)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = ranker_pb2_grpc.RankerServiceStub(channel)
            request = rank_input(rng, prefix(rng, 100))
            await stub.PreInfer(pre_infer_request_to_proto(request.prefix))
            reply = await stub.Rank(rank_request_to_proto(request))
            assert reply.cache_outcome == common_pb2.CACHE_OUTCOME_HBM_HIT
    finally:
        await server.stop(grace=0.5)
    telemetry.shutdown()
    assert _exporter_threads() == []
    assert otlp_receiver.exports == 0
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


async def test_ranks_that_shared_a_model_call_carry_its_size_to_the_collector(
    otlp_receiver: OtlpReceiver, rng: np.random.Generator
) -> None:
    """Three Ranks queued behind a held worker run as one batched call: the Rank server span
    and the `ranker.rank` compute span of each, as a real OTLP collector receives them, carry
    the call's request count and rows."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint}
    telemetry = Telemetry.from_env("relaygr-ranker", env)
    cfg = replace(BASE, batch_backlog=1)  # queued Ranks share a call whatever they save
    server = await start_ranker(cfg, model=tiny_model(), cost_model=COST, telemetry=telemetry)
    requests = [
        rank_input(rng, prefix(rng, 100, user_id=f"u{i}"), int(rng.integers(1, 17)),
                   int(rng.integers(1, 33)))
        for i in range(3)
    ]  # fmt: skip
    rows = sum(len(r.short_term) + len(r.candidates) for r in requests)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = ranker_pb2_grpc.RankerServiceStub(channel)
            for r in requests:
                await stub.PreInfer(pre_infer_request_to_proto(r.prefix))
            ranker = Ranker(server, stub, channel)
            gate = Gate(ranker)
            await gate.wait_entered()
            replies = [asyncio.ensure_future(stub.Rank(rank_request_to_proto(r))) for r in requests]
            queued = lambda: ranker.engine.queues.depth(Priority.RANK) == 3  # noqa: E731
            await eventually(queued, "the Ranks queued behind the held worker")
            gate.open()
            for reply in await asyncio.gather(*replies):
                assert reply.cache_outcome == common_pb2.CACHE_OUTCOME_HBM_HIT
        assert telemetry.tracer_provider is not None
        await asyncio.to_thread(telemetry.tracer_provider.force_flush)

        def rank_spans() -> list[ReceivedSpan]:
            return [
                s for s in otlp_receiver.spans()
                if s.name == "/relaygr.v1.RankerService/Rank" and s.kind == SERVER
            ]  # fmt: skip

        await eventually(lambda: len(rank_spans()) == 3, "the Rank spans exported", 30)
    finally:
        await server.stop(grace=0.5)
        telemetry.shutdown()
    spans = otlp_receiver.spans()
    for rank in rank_spans():
        compute = one(spans, name="ranker.rank", parent_id=rank.span_id)
        for span in (rank, compute):
            assert span.attributes["relaygr.batch.requests"] == 3
            assert span.attributes["relaygr.batch.rows"] == rows


def test_a_ranker_process_traces_serves_metrics_and_logs_json(
    otlp_receiver: OtlpReceiver, rng: np.random.Generator
) -> None:
    """`relaygr ranker` as deployed: OTEL_* from its environment, --metrics-port, JSON logs."""
    metrics_port = free_ports(1)
    process = subprocess.Popen(
        [
            sys.executable, "-m", "tooling.cli", "ranker", "--listen", "127.0.0.1:0",
            "--plaintext", "--model", "tiny", "--device", "cpu",
            "--calibration-lengths", "32,64", "--instance-id", "ranker-obs",
            "--metrics-port", str(metrics_port), "--log-level", "INFO", "--log-format", "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        },
    )  # fmt: skip
    lines: list[str] = []
    try:
        port = wait_for_port(process)
        assert process.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)  # type: ignore[arg-type]
        reader.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ranker_pb2_grpc.RankerServiceStub(channel)
            request = rank_input(rng, prefix(rng, 100))
            stub.PreInfer(pre_infer_request_to_proto(request.prefix), timeout=30)
            reply = stub.Rank(rank_request_to_proto(request), timeout=30)
            assert reply.cache_outcome == common_pb2.CACHE_OUTCOME_HBM_HIT
        text = _scrape(metrics_port)
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["relaygr_ranker_rank_latency_seconds"].type == "histogram"
        assert families["relaygr_ranker_relays_consumed"].type == "counter"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0  # drained, then flushed its spans
        reader.join(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    spans = otlp_receiver.spans()
    assert {s.service for s in spans} == {"relaygr-ranker"}
    assert spans[0].resource["service.instance.id"] == "ranker-obs"
    pre_infer = one(spans, name="/relaygr.v1.RankerService/PreInfer")
    rank = one(spans, name="/relaygr.v1.RankerService/Rank")
    assert [(link.trace_id, link.span_id) for link in rank.links] == [
        (pre_infer.trace_id, pre_infer.span_id)
    ]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert any(r["service"] == "ranker" and "SIGTERM" in r["message"] for r in records)


def test_the_local_mesh_passes_otel_env_and_serves_metrics(
    otlp_receiver: OtlpReceiver,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`relaygr up` pointed at a collector: one trace across three processes, linked Rank."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    spec, _ = tiny_mesh(
        rankers=1,
        trigger_args=("--mode", "all", "--relay-window-ms", "20000"),  # slow shared machines
        metrics_base_port=free_ports(3),
    )
    request = rank_input(rng, prefix(rng, 300, user_id="alice"), 16, 8)
    with LocalMesh(spec) as mesh:
        assert mesh.trigger is not None and mesh.router is not None
        with grpc.insecure_channel(mesh.trigger.address) as channel:
            trigger = trigger_pb2_grpc.TriggerServiceStub(channel)
            assert trigger.OnRetrieval(retrieval_event(request, "r1"), timeout=10).admitted
        trigger_metrics = mesh.trigger.metrics_port
        relayed = "relaygr_trigger_dispatches_total"
        asyncio.run(
            eventually(
                lambda: _value(_samples_now(trigger_metrics), relayed, outcome="relayed") == 1,
                "the relay landed",
                timeout_s=60,
            )
        )
        with grpc.insecure_channel(mesh.router.address) as channel:
            reply = router_pb2_grpc.RouterServiceStub(channel).Rank(
                rank_request_to_proto(request), timeout=10
            )
        assert reply.cache_outcome == common_pb2.CACHE_OUTCOME_HBM_HIT
        for service in (*mesh.rankers, mesh.router, mesh.trigger):
            assert "relaygr_etcd_connected 1.0" in _scrape(service.metrics_port), service.name
        assert "metrics http://127.0.0.1:" in mesh.describe()
    # Stopped: every process drained and flushed its spans on the way out.
    spans = otlp_receiver.spans()
    assert {s.service for s in spans} == set(SERVICES)
    pre_infer = one(spans, service="relaygr-ranker", name="/relaygr.v1.RankerService/PreInfer")
    origin = one(spans, name="/relaygr.v1.TriggerService/OnRetrieval")
    assert pre_infer.trace_id == origin.trace_id
    rank = one(spans, service="relaygr-ranker", name="/relaygr.v1.RankerService/Rank")
    assert rank.trace_id != origin.trace_id
    assert [(link.trace_id, link.span_id) for link in rank.links] == [
        (pre_infer.trace_id, pre_infer.span_id)
    ]
