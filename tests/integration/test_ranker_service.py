"""RankerService on a real gRPC server over loopback: the relay, its outcomes, its limits."""

import asyncio
import time

import grpc
import numpy as np
import pytest
import torch

from relaygr.behaviours import RankInput
from relaygr.pool import RankerPool
from relaygr.room import RelayRoom
from relaygr.room_poll import RoomPoller
from relaygr.tls_settings import PLAINTEXT
from relaygr.v1 import common_pb2, ranker_pb2
from relaygr.wire import pre_infer_request_to_proto, rank_request_to_proto
from services.ranker.kv_store import Tier
from services.ranker.queues import Priority
from tests.integration.ranker_harness import (
    COST,
    NO_CALL_COST,
    Gate,
    poll,
    reverse_timestamp,
    running_ranker,
    tiny_model,
)
from tests.unit.ranker.factories import longer, prefix, rank_input, rel_err
from tests.unit.trigger.test_policy import ranker

Outcome = common_pb2.CacheOutcome


def _expected(model, request: RankInput) -> np.ndarray:  # type: ignore[no-untyped-def]
    return model.full_forward(request).numpy()


async def test_every_cache_outcome_returns_full_inference_scores(rng: np.random.Generator) -> None:
    model = tiny_model()
    kv_bytes = 305 * (model.cfg.kv_bytes_per_token + 8)

    async with running_ranker(model, NO_CALL_COST, hbm_budget_mb=2.5 * kv_bytes / 2**20) as r:
        seen: dict[int, float] = {}
        relayed: list[tuple[int, bool]] = []

        async def rank(request: RankInput) -> int:
            reply = await r.stub.Rank(rank_request_to_proto(request))
            seen[reply.cache_outcome] = rel_err(r.scores(reply), _expected(model, request))
            relayed.append((reply.cache_outcome, reply.relayed))
            return reply.cache_outcome

        # HBM hit: pre-infer, then rank.
        a = rank_input(rng, prefix(rng, 300, n_user=5, user_id="a"))
        reply = await r.stub.PreInfer(pre_infer_request_to_proto(a.prefix))
        assert reply.outcome == common_pb2.PRE_INFER_OUTCOME_COMPUTED
        assert reply.prefix_tokens == 305 and reply.kv_bytes == kv_bytes
        assert await rank(a) == Outcome.CACHE_OUTCOME_HBM_HIT
        # A return visit finds a's prefix still resident: a cross-visit hit, not a relay.
        assert await rank(rank_input(rng, a.prefix)) == Outcome.CACHE_OUTCOME_HBM_HIT
        # Waited in flight: the Rank arrives while its PreInfer is queued behind a gate.
        f = rank_input(rng, prefix(rng, 200, user_id="f"))
        gate = Gate(r)
        await gate.wait_entered()
        pre = asyncio.ensure_future(r.stub.PreInfer(pre_infer_request_to_proto(f.prefix)))
        await poll(lambda: r.engine.computing(r.engine.key(f.prefix)))
        ranked = asyncio.ensure_future(rank(f))
        await poll(lambda: any(e.kind == "promoted" for e in r.engine.queues.events))
        gate.open()
        assert await ranked == Outcome.CACHE_OUTCOME_WAITED_INFLIGHT
        assert (await pre).outcome == common_pb2.PRE_INFER_OUTCOME_COMPUTED
        # Extended: the user's cached prefix is a strict prefix of the new one.
        e = prefix(rng, 120, n_user=2, user_id="e")
        await r.stub.PreInfer(pre_infer_request_to_proto(e))
        assert await rank(rank_input(rng, longer(rng, e, 40))) == Outcome.CACHE_OUTCOME_EXTENDED
        # Miss: nothing cached for b; served by full inference, prefix kept for later.
        b = rank_input(rng, prefix(rng, 300, n_user=5, user_id="b"))
        assert await rank(b) == Outcome.CACHE_OUTCOME_MISS
        # DRAM hit: two pinned pre-infers push b out of the device tier into host memory.
        for user in ("c", "d"):
            p = prefix(rng, 300, n_user=5, user_id=user)
            await r.stub.PreInfer(pre_infer_request_to_proto(p))
        assert r.engine.store.tier_of(r.engine.key(b.prefix)) is Tier.DRAM
        assert await rank(b) == Outcome.CACHE_OUTCOME_DRAM_HIT
    # RankReply.relayed: only what a PreInfer produced for this visit counts as relayed.
    assert relayed == [
        (Outcome.CACHE_OUTCOME_HBM_HIT, True),
        (Outcome.CACHE_OUTCOME_HBM_HIT, False),
        (Outcome.CACHE_OUTCOME_WAITED_INFLIGHT, True),
        (Outcome.CACHE_OUTCOME_EXTENDED, False),
        (Outcome.CACHE_OUTCOME_MISS, False),
        (Outcome.CACHE_OUTCOME_DRAM_HIT, False),
    ]
    assert set(seen) == {
        Outcome.CACHE_OUTCOME_HBM_HIT,
        Outcome.CACHE_OUTCOME_MISS,
        Outcome.CACHE_OUTCOME_DRAM_HIT,
        Outcome.CACHE_OUTCOME_EXTENDED,
        Outcome.CACHE_OUTCOME_WAITED_INFLIGHT,
    }
    assert max(seen.values()) <= 1e-5, seen


async def test_bypass_serves_full_inference(rng: np.random.Generator) -> None:
    model = tiny_model()

    async with running_ranker(model, relay_enabled=False) as r:
        request = rank_input(rng, prefix(rng, 100))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.stub.PreInfer(pre_infer_request_to_proto(request.prefix))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "relay is disabled" in (err.value.details() or "")
        reply = await r.stub.Rank(rank_request_to_proto(request))
        assert reply.cache_outcome == Outcome.CACHE_OUTCOME_BYPASS
        assert rel_err(r.scores(reply), _expected(model, request)) <= 1e-5
        info = await r.stub.Describe(ranker_pb2.DescribeRequest())
        assert not info.relay_enabled


async def test_concurrent_requests_for_one_user_cause_one_prefill(rng: np.random.Generator) -> None:
    model = tiny_model()

    async with running_ranker(model) as r:
        request = rank_input(rng, prefix(rng, 1500))
        calls = [r.stub.PreInfer(pre_infer_request_to_proto(request.prefix)) for _ in range(16)]
        calls += [r.stub.Rank(rank_request_to_proto(request)) for _ in range(16)]
        order = rng.permutation(len(calls))
        replies = await asyncio.gather(*(calls[i] for i in order))
        prefills = [
            e for e in r.engine.queues.events if e.kind == "submitted" and "prefill" in e.job
        ]
        assert len(prefills) == 1
        expected = _expected(model, request)
        for reply in replies:
            if isinstance(reply, common_pb2.RankReply):
                assert rel_err(r.scores(reply), expected) <= 1e-5


async def test_a_rank_waits_at_most_one_chunk_behind_a_long_prefill(
    rng: np.random.Generator,
) -> None:
    model = tiny_model(max_history_tokens=8192)

    async with running_ranker(model, prefill_chunk_tokens=256) as r:
        warm = rank_input(rng, prefix(rng, 100, user_id="warm"))
        await r.stub.PreInfer(pre_infer_request_to_proto(warm.prefix))
        long = prefix(rng, 4096, user_id="long")
        pre = asyncio.ensure_future(r.stub.PreInfer(pre_infer_request_to_proto(long)))
        events = r.engine.queues.events
        await poll(lambda: any(e.kind == "step" and "long" in e.job for e in events))
        reply = await r.stub.Rank(rank_request_to_proto(warm))
        assert reply.cache_outcome == Outcome.CACHE_OUTCOME_HBM_HIT
        await pre
        log = list(events)
        submitted = next(e.seq for e in log if e.kind == "submitted" and e.job == "rank")
        started = next(e.seq for e in log if e.kind == "step" and e.job == "rank")
        chunks = [e for e in log if e.kind == "step" and "long" in e.job]
        overtaking = [e for e in chunks if submitted < e.seq < started]
        assert len(chunks) > 4096 // 256  # the prefill really ran in chunks
        assert overtaking == []  # only the chunk already running finished before the rank


async def test_a_burst_of_pre_infers_never_exceeds_the_device_budget(
    rng: np.random.Generator,
) -> None:
    model = tiny_model()
    per_prefix = 404 * (model.cfg.kv_bytes_per_token + 8)
    budget = int(3.5 * per_prefix)

    # Pins outlast the burst however slow the machine: all ten relays compete for room.
    async with running_ranker(model, hbm_budget_mb=budget / 2**20, relay_window_ms=60_000) as r:
        store = r.engine.store
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, store.usage(Tier.HBM).used_bytes)
                await asyncio.sleep(0)

        watcher = asyncio.ensure_future(watch())
        requests = [rank_input(rng, prefix(rng, 400, user_id=f"u{i}")) for i in range(10)]
        results = await asyncio.gather(
            *(r.stub.PreInfer(pre_infer_request_to_proto(q.prefix)) for q in requests),
            return_exceptions=True,
        )
        refused = [x for x in results if isinstance(x, grpc.aio.AioRpcError)]
        assert 0 < len(refused) < 10
        assert all(x.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for x in refused)
        # Every user is still ranked correctly, cached or not.
        for request in requests:
            reply = await r.stub.Rank(rank_request_to_proto(request))
            assert rel_err(r.scores(reply), _expected(model, request)) <= 1e-5
        watcher.cancel()
        assert peak <= budget
        assert store.usage(Tier.HBM).used_bytes <= budget


async def test_bad_input_gets_a_clear_status_and_the_server_keeps_serving(
    rng: np.random.Generator,
) -> None:
    model = tiny_model(max_candidates=16, max_history_tokens=600)

    async with running_ranker(model, hbm_budget_mb=0.1, max_message_mb=1) as r:
        good = rank_input(rng, prefix(rng, 50), n_candidates=4)

        def bad(**changes: object) -> common_pb2.RankRequest:
            msg = rank_request_to_proto(good)
            for name, value in changes.items():
                if name == "actions":
                    del msg.long_term.actions[-1]
                elif isinstance(value, list):
                    getattr(msg, name)[:] = value
                else:
                    setattr(msg, name, value)
            return msg

        invalid = {
            "user_id must not be empty": bad(user_id=""),
            "ragged behaviour arrays": bad(actions=True),
            "650 tokens": rank_request_to_proto(
                RankInput(prefix(rng, 646), good.short_term, good.candidates, good.request_ts)
            ),
            "17 candidates exceed the limit of 16": bad(candidate_ids=list(range(17))),
            "at least one candidate": bad(candidate_ids=[]),
            "user_id is longer than 256 bytes": bad(user_id="x" * 300),
        }
        for message, request in invalid.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.stub.Rank(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert message in (err.value.details() or ""), err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.stub.Rank(bad(candidate_ids=list(range(2**60, 2**60 + 300_000))))  # 2.7 MB
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as err:  # 0.1 MiB device tier
            await r.stub.PreInfer(pre_infer_request_to_proto(prefix(rng, 590)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "bytes" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:  # would pin memory for ~49 days
            await r.stub.PreInfer(
                pre_infer_request_to_proto(prefix(rng, 20), relay_window_ms=2**32 - 1)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_relay_window_ms" in (err.value.details() or "")
        reply = await r.stub.Rank(rank_request_to_proto(good))
        assert rel_err(r.scores(reply), _expected(model, good)) <= 1e-5


async def test_each_limit_admits_exactly_its_value_and_refuses_one_more(
    rng: np.random.Generator,
) -> None:
    """Inclusive limits end to end (the wire's length checks, then the engine's), at values
    other than the defaults: exactly at a limit is served exactly, one more is
    INVALID_ARGUMENT naming the limit."""
    cap, tokens, features = 12, 300, 6
    model = tiny_model(max_candidates=cap, max_history_tokens=tokens, max_user_features=features)

    def request(n_user: int, n_long: int, n_short: int, candidates: int) -> RankInput:
        return rank_input(rng, prefix(rng, n_long, n_user=n_user), n_short, candidates)

    async with running_ranker(model) as r:
        at = [
            request(4, 50, 4, cap),
            request(features, 40, 4, 3),
            request(4, tokens - 4, 0, 3),  # the prefix alone at the limit
            request(4, tokens - 4 - 20, 20, 3),  # prefix and short-term at the limit
        ]
        for good in at:
            reply = await r.stub.Rank(rank_request_to_proto(good))
            assert rel_err(r.scores(reply), _expected(model, good)) <= 1e-5
        full = prefix(rng, tokens - features, n_user=features)
        reply = await r.stub.PreInfer(pre_infer_request_to_proto(full))
        assert reply.prefix_tokens == tokens
        over = {
            f"{cap + 1} candidates exceed the limit of {cap}": request(4, 50, 4, cap + 1),
            f"{features + 1} user features exceed the limit of {features}": request(
                features + 1, 40, 4, 3
            ),
            f"prefix has {tokens + 1} tokens": request(4, tokens - 3, 0, 3),
            f"request has {tokens + 1} history tokens": request(4, tokens - 4 - 19, 20, 3),
        }
        for message, bad in over.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.stub.Rank(rank_request_to_proto(bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert message in (err.value.details() or ""), err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.stub.PreInfer(pre_infer_request_to_proto(prefix(rng, tokens - 3, n_user=4)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"prefix has {tokens + 1} tokens" in (err.value.details() or "")


async def test_reversed_timestamps_are_refused_before_any_cache_is_made(
    rng: np.random.Generator,
) -> None:
    async with running_ranker() as r:
        good = rank_input(rng, prefix(rng, 40, user_id="late"))
        pre_infer = pre_infer_request_to_proto(good.prefix)
        rank_long, rank_short = rank_request_to_proto(good), rank_request_to_proto(good)
        refusals = [
            (r.stub.PreInfer, pre_infer, reverse_timestamp(pre_infer.long_term, "long_term", 17)),
            (r.stub.Rank, rank_long, reverse_timestamp(rank_long.long_term, "long_term", 17)),
            (r.stub.Rank, rank_short, reverse_timestamp(rank_short.short_term, "short_term", 3)),
        ]
        for call, request, message in refusals:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
            assert err.value.details() == message
        assert r.engine.store.usage(Tier.HBM).entries == 0
        assert r.engine.store.usage(Tier.DRAM).entries == 0
        # The server keeps serving: the same user's good requests relay.
        assert (await r.stub.PreInfer(pre_infer_request_to_proto(good.prefix))).prefix_tokens == 44
        reply = await r.stub.Rank(rank_request_to_proto(good))
        assert reply.cache_outcome == Outcome.CACHE_OUTCOME_HBM_HIT
        assert rel_err(r.scores(reply), _expected(r.engine.model, good)) <= 1e-5


async def test_deadlines_and_overload_shed_with_clear_statuses(rng: np.random.Generator) -> None:
    async with running_ranker(max_queued_ranks=2) as r:
        requests = [
            rank_request_to_proto(rank_input(rng, prefix(rng, 30, user_id=f"u{i}")))
            for i in range(3)
        ]
        gate = Gate(r)  # the worker is busy: everything queues
        await gate.wait_entered()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.stub.Rank(requests[0], timeout=0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        queued = asyncio.ensure_future(r.stub.Rank(requests[1]))
        await poll(lambda: r.engine.queues.depth(Priority.RANK) >= 2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.stub.Rank(requests[2])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overloaded" in (err.value.details() or "")
        gate.open()
        assert len((await queued).scores) == 2
        # The expired job was dropped unrun; the server serves the shed request now.
        assert any(e.kind == "expired" for e in r.engine.queues.events)
        assert len((await r.stub.Rank(requests[2])).scores) == 2


async def test_describe_reports_model_tiers_and_cost_model() -> None:
    async with running_ranker(hbm_budget_mb=3, dram_budget_mb=5) as r:
        info = await r.stub.Describe(ranker_pb2.DescribeRequest())
        model = r.engine.model
        assert info.model_version == model.model_version
        assert info.dims.layers == model.cfg.num_layers
        assert info.hbm.budget_bytes == 3 * 2**20 and info.dram.budget_bytes == 5 * 2**20
        assert info.cost_model.per_token_ms == pytest.approx(0.01)
        assert info.instance_id.endswith(f":{r.server.port}")
        assert info.device == "cpu"


async def test_a_client_sizes_a_prefix_from_describe_as_the_ranker_does(
    rng: np.random.Generator,
) -> None:
    """ModelDims says what the cache holds: K, V and timestamp bytes per token from the widths
    (which differ: d_qk 16, d_v 32), adding up to what a real prefix takes."""
    model = tiny_model(kv_dtype="bfloat16")
    async with running_ranker(model) as r:
        dims = (await r.stub.Describe(ranker_pb2.DescribeRequest())).dims
        cfg = model.cfg
        assert (dims.layers, dims.heads, dims.d_qk, dims.d_v) == (3, 2, cfg.d_qk, cfg.d_v) == (
            3, 2, 16, 32,
        )  # fmt: skip
        assert dims.kv_dtype == "bfloat16"
        element = 2
        assert dims.k_bytes_per_token == dims.layers * dims.heads * dims.d_qk * element
        assert dims.v_bytes_per_token == dims.layers * dims.heads * dims.d_v * element
        assert dims.timestamp_bytes_per_token == 8
        assert dims.cache_bytes_per_token == (
            dims.k_bytes_per_token + dims.v_bytes_per_token + dims.timestamp_bytes_per_token
        )
        p = prefix(rng, 300, n_user=5)
        reply = await r.stub.PreInfer(pre_infer_request_to_proto(p))
        assert reply.prefix_tokens == 305
        assert reply.kv_bytes == 305 * dims.cache_bytes_per_token
        entry = r.engine.store.peek(r.engine.key(p), Tier.HBM)
        assert entry is not None and entry.kv.nbytes == reply.kv_bytes  # the tensors held
        assert r.engine.store.usage(Tier.HBM).used_bytes == reply.kv_bytes
        # The deprecated fields keep their released values.
        assert dims.d_head == dims.d_v
        assert dims.kv_bytes_per_token == dims.cache_bytes_per_token


async def test_health_is_not_serving_until_calibrated_then_drain_refuses_pre_infer(
    rng: np.random.Generator,
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with running_ranker(cost=None) as r:  # calibrates on start
        health = health_pb2_grpc.HealthStub(r.channel)
        status = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert r.engine.cost_model.full_ms(64, 8) > 0  # fitted on this machine at start-up
        request = rank_input(rng, prefix(rng, 40))
        await r.engine.drain()  # nothing in flight: refuses pre-inference from now
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await r.stub.PreInfer(pre_infer_request_to_proto(request.prefix))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        reply = await r.stub.Rank(rank_request_to_proto(request))  # ranks still served
        assert reply.cache_outcome == Outcome.CACHE_OUTCOME_MISS


async def test_scores_come_back_as_float32_probabilities(rng: np.random.Generator) -> None:
    async with running_ranker() as r:
        request = rank_input(rng, prefix(rng, 20), n_candidates=5)
        reply = await r.stub.Rank(rank_request_to_proto(request))
        assert [t.task for t in reply.scores] == ["click", "like"]
        values = torch.tensor([list(t.scores) for t in reply.scores])
        assert values.shape == (2, 5) and bool(((values > 0) & (values < 1)).all())


async def test_a_rank_outlives_the_deadline_of_the_pre_infer_it_waits_for(
    rng: np.random.Generator,
) -> None:
    model = tiny_model()

    async with running_ranker(model, NO_CALL_COST) as r:
        request = rank_input(rng, prefix(rng, 200))
        gate = Gate(r)
        await gate.wait_entered()
        pre = asyncio.ensure_future(
            r.stub.PreInfer(pre_infer_request_to_proto(request.prefix), timeout=0.3)
        )
        await poll(lambda: r.engine.computing(r.engine.key(request.prefix)))
        ranked = asyncio.ensure_future(r.stub.Rank(rank_request_to_proto(request)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pre  # its caller gives up while the worker is held
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.open()
        reply = await ranked
        assert reply.cache_outcome == Outcome.CACHE_OUTCOME_WAITED_INFLIGHT
        assert rel_err(r.scores(reply), _expected(model, request)) <= 1e-5


async def test_describe_reports_queued_prefill_time_and_pre_infer_sets_its_due(
    rng: np.random.Generator,
) -> None:
    async with running_ranker() as r:  # 64-token chunks, COST: 1 ms a call
        gate = Gate(r)
        await gate.wait_entered()
        assert (await r.stub.Describe(ranker_pb2.DescribeRequest())).queued_prefill_ms == 0.0
        p = prefix(rng, 100, user_id="a")  # 104 tokens: two calls
        msg = pre_infer_request_to_proto(p)
        msg.rank_expected_in_ms = 5_000
        sent = time.monotonic()
        pre = asyncio.ensure_future(r.stub.PreInfer(msg))
        await poll(lambda: r.engine.inflight() == 1)
        [inflight] = r.engine.core.flights.values()
        assert inflight.job.due is not None
        assert sent + 5.0 <= inflight.job.due <= time.monotonic() + 5.0
        info = await r.stub.Describe(ranker_pb2.DescribeRequest())
        assert info.queued_prefill_ms == pytest.approx(COST.prefill_ms(104) + COST.fixed_ms)
        gate.open()
        assert (await pre).outcome == common_pb2.PRE_INFER_OUTCOME_COMPUTED
        assert (await r.stub.Describe(ranker_pb2.DescribeRequest())).queued_prefill_ms == 0.0


async def test_describe_reports_queued_rank_work(rng: np.random.Generator) -> None:
    async with running_ranker() as r:  # 64-token chunks, COST: 1 ms a call
        gate = Gate(r)
        await gate.wait_entered()
        assert (await r.stub.Describe(ranker_pb2.DescribeRequest())).queued_rank_ms == 0.0
        request = rank_input(rng, prefix(rng, 100, user_id="a"))  # a miss: 104-token prefix
        ranked = asyncio.ensure_future(r.stub.Rank(rank_request_to_proto(request)))
        await poll(lambda: r.engine.inflight() == 1)
        info = await r.stub.Describe(ranker_pb2.DescribeRequest())
        # The miss is one call at rank priority, its full inference (keeping the prefix): rank
        # work, not background.
        history = request.history_tokens
        assert info.queued_rank_ms == pytest.approx(COST.full_ms(history, len(request.candidates)))
        assert info.queued_prefill_ms == 0.0
        gate.open()
        await ranked
        assert (await r.stub.Describe(ranker_pb2.DescribeRequest())).queued_rank_ms == 0.0


async def test_describe_reports_how_relays_ended_ranked_or_never(rng: np.random.Generator) -> None:
    # The trigger reads the share of relays no Rank consumed as the no-show share.
    async with running_ranker() as r:
        ranked = rank_input(rng, prefix(rng, 20, user_id="ranked"))
        await r.stub.PreInfer(pre_infer_request_to_proto(ranked.prefix))
        no_show = pre_infer_request_to_proto(prefix(rng, 20, user_id="gone"), relay_window_ms=50)
        await r.stub.PreInfer(no_show)
        reply = await r.stub.Rank(rank_request_to_proto(ranked))
        assert reply.cache_outcome == Outcome.CACHE_OUTCOME_HBM_HIT

        def expired() -> bool:
            r.engine.tick()
            return r.engine.stats().kv.relays_expired_unconsumed == 1

        await poll(expired)
        info = await r.stub.Describe(ranker_pb2.DescribeRequest())
        assert (info.relays_consumed, info.relays_expired_unconsumed) == (1, 1)


async def test_describe_reports_the_tail_of_relays_waits_for_their_rank(
    rng: np.random.Generator,
) -> None:
    # A trigger with relay_window_wait_factor sizes its relays' windows from this tail.
    async with running_ranker() as r:
        assert (await r.stub.Describe(ranker_pb2.DescribeRequest())).relay_wait_p99_ms == 0.0
        longest = 0.0
        for i in range(100):  # the fewest Ranks a tail is reported from
            request = rank_input(rng, prefix(rng, 8, user_id=f"u{i}"), 2, 2)
            sent = time.monotonic()  # before the pin: the ranker's wait is no longer
            await r.stub.PreInfer(pre_infer_request_to_proto(request.prefix))
            reply = await r.stub.Rank(rank_request_to_proto(request))
            longest = max(longest, time.monotonic() - sent)
            assert reply.cache_outcome == Outcome.CACHE_OUTCOME_HBM_HIT
        info = await r.stub.Describe(ranker_pb2.DescribeRequest())
        assert 0.0 < info.relay_wait_p99_ms <= longest * 1e3
        # What the trigger's and the router's room poller books of it.
        room, pool = RelayRoom(window_s=60.0), RankerPool([], PLAINTEXT)
        try:
            record = ranker("r", address=f"127.0.0.1:{r.server.port}")
            await RoomPoller(room, pool, lambda: {"r": record}, 1.0).poll_once()
        finally:
            await pool.close()
        seen = room.report("r", time.monotonic())
        assert seen is not None
        assert (seen.relays_consumed, seen.relay_wait_p99_ms) == (100, info.relay_wait_p99_ms)
