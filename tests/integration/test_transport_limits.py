"""Configured limits on loopback: each refuses with a clear status and the server keeps serving."""

import asyncio

import grpc
import numpy as np
import pytest

from relaygr.tls import open_channel
from relaygr.tls_settings import PLAINTEXT
from relaygr.v1 import ranker_pb2_grpc, trigger_pb2
from relaygr.wire import (
    behaviours_to_proto,
    pre_infer_request_to_proto,
    rank_request_to_proto,
)
from services.ranker.queues import Priority
from services.router.forward import RouterStats
from tests.integration.etcd_server import EtcdServer
from tests.integration.mesh_harness import running_mesh
from tests.integration.ranker_harness import Gate, poll, reply_scores, running_ranker, tiny_model
from tests.unit.ranker.factories import prefix, rank_input, rel_err


async def _refused(call: object, request: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(request)  # type: ignore[operator]
    return err.value


async def test_the_router_refuses_too_many_tokens_or_candidates_before_forwarding(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    model = tiny_model()  # its own limits (4096 tokens, 64 candidates) are far above these

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        await mesh.add_ranker("r0")
        router = await mesh.add_router(max_tokens=100, max_candidates=10)
        servicer = mesh.routers[0].servicer
        at_limit = rank_input(rng, prefix(rng, 90, n_user=4), n_short=6, n_candidates=10)
        too_long = rank_input(rng, prefix(rng, 91, n_user=4), n_short=6, n_candidates=10)
        too_wide = rank_input(rng, prefix(rng, 10), n_short=6, n_candidates=11)
        refusals = [
            (router.Rank, rank_request_to_proto(too_long), "101 history tokens"),
            (router.PreInfer, pre_infer_request_to_proto(prefix(rng, 97)), "101 history"),
            (router.Rank, rank_request_to_proto(too_wide), "11 candidates exceed"),
        ]
        for call, request, message in refusals:
            err = await _refused(call, request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert message in (err.details() or "") and "router's limit" in (err.details() or "")
        assert not servicer.load.loads()
        assert servicer.stats == RouterStats()  # nothing forwarded
        reply = await router.Rank(rank_request_to_proto(at_limit))
        assert rel_err(reply_scores(reply), model.full_forward(at_limit).numpy()) <= 1e-5


async def test_the_ranker_refuses_an_overlong_array_before_copying_it(
    rng: np.random.Generator,
) -> None:
    """A ragged request with a million timestamps (1 MB, within the message limit) is refused
    for its length, not for being ragged: the check reads the message, not a built array."""
    model = tiny_model()

    async with running_ranker(model) as r:
        good = rank_input(rng, prefix(rng, 50), n_candidates=4)
        request = rank_request_to_proto(good)
        request.long_term.timestamps.extend([1] * 1_000_000)
        for call, message in ((r.stub.Rank, request), (r.stub.PreInfer, None)):
            if message is None:
                message = pre_infer_request_to_proto(good.prefix)
                message.user_features.extend(range(100))
                expected = "104 user features exceed the limit of 8"
            else:
                expected = "prefix has 1000054 tokens"
            err = await _refused(call, message)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert expected in (err.details() or ""), err.details()
        reply = await r.stub.Rank(rank_request_to_proto(good))
        assert rel_err(r.scores(reply), model.full_forward(good).numpy()) <= 1e-5


async def test_the_trigger_refuses_oversized_messages_and_too_many_user_features(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    async with running_mesh(etcd_server.endpoint, tiny_model()) as mesh:
        await mesh.add_ranker("r0")
        await mesh.add_router()
        trigger = await mesh.add_trigger(max_message_mb=1, max_user_features=4, mode="off")
        p = prefix(rng, 40, n_user=4)
        event = trigger_pb2.RetrievalEvent(
            user_id="u", user_features=p.user_features.tolist(), expected_candidates=8,
            long_term=behaviours_to_proto(p.long_term),
        )  # fmt: skip
        wide = trigger_pb2.RetrievalEvent()
        wide.CopyFrom(event)
        wide.user_features.append(5)
        err = await _refused(trigger.OnRetrieval, wide)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "5 user features exceed the limit of 4" in (err.details() or "")
        huge = trigger_pb2.RetrievalEvent()
        huge.CopyFrom(event)
        huge.request_id = "x" * (2 << 20)  # refused by gRPC before it is parsed
        err = await _refused(trigger.OnRetrieval, huge)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (err.details() or ""), err.details()
        decision = await trigger.OnRetrieval(event)
        assert decision.reason == trigger_pb2.ADMISSION_REASON_RELAY_DISABLED


async def test_past_max_concurrent_rpcs_the_ranker_sheds_at_once_then_serves(
    rng: np.random.Generator,
) -> None:
    async with running_ranker(max_concurrent_rpcs=2) as r:
        requests = [
            rank_request_to_proto(rank_input(rng, prefix(rng, 30, user_id=f"u{i}")))
            for i in range(4)
        ]
        gate = Gate(r)  # the compute worker is held: Ranks stay in progress
        await gate.wait_entered()
        in_progress = [asyncio.ensure_future(r.stub.Rank(q)) for q in requests[:2]]
        await poll(lambda: r.engine.queues.depth(Priority.RANK) == 2)
        err = await _refused(r.stub.Rank, requests[2])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "concurrent" in (err.details() or "").lower(), err.details()
        gate.open()
        for future in in_progress:
            assert len((await future).scores) == 2
        assert len((await r.stub.Rank(requests[3])).scores) == 2


async def test_max_concurrent_streams_holds_a_connections_extra_rpcs_until_one_ends(
    rng: np.random.Generator,
) -> None:
    """At one stream per connection, a second RPC on a busy connection waits in the client (it
    does not reach the server), while another connection is served; both finish afterwards."""

    async with running_ranker(max_concurrent_streams=1) as r:
        requests = [
            rank_request_to_proto(rank_input(rng, prefix(rng, 30, user_id=f"u{i}")))
            for i in range(3)
        ]
        # Its own connection: channels with equal arguments would share one.
        other = open_channel(
            f"127.0.0.1:{r.server.port}", PLAINTEXT, [("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            gate = Gate(r)
            await gate.wait_entered()
            events = r.engine.queues.events

            def arrived(user: str) -> bool:  # its job reached the held compute worker
                return any(e.kind == "submitted" and e.job.endswith(f":{user}") for e in events)

            first = asyncio.ensure_future(r.stub.Rank(requests[0]))
            await poll(lambda: arrived("u0"))
            held = asyncio.ensure_future(r.stub.Rank(requests[1]))
            elsewhere = asyncio.ensure_future(
                ranker_pb2_grpc.RankerServiceStub(other).Rank(requests[2])
            )
            await poll(lambda: arrived("u2"))  # sent after `held`, on a new connection
            assert not arrived("u1") and not held.done()
            gate.open()
            for future in (first, held, elsewhere):
                assert len((await future).scores) == 2
        finally:
            await other.close()
