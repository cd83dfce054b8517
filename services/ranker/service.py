"""RankerService over gRPC: translates relaygr.v1 messages to the engine's domain and back."""

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import torch

from relaygr.authz_grpc import peer_identity
from relaygr.behaviours import UserId
from relaygr.errors import FailedPrecondition
from relaygr.grpc_server import absolute_deadline
from relaygr.tracing import annotate, child_span, recording, root_span
from relaygr.v1 import common_pb2, ranker_pb2, ranker_pb2_grpc
from relaygr.wire import prefix_from_proto, rank_input_from_proto
from services.ranker.digest import PrefixDigest
from services.ranker.engine import CacheOutcome, PreInferOutcome, RankerEngine
from services.ranker.handoff_grpc import SENDER_KEY, HandoffReceiving
from services.ranker.handoff_intake import HandoffIntake
from services.ranker.kv_store import CacheKey, Tier
from services.ranker.metrics import RankerMetrics
from services.ranker.model_config import TIMESTAMP_BYTES
from services.ranker.prefix_kv import ModelVersion
from services.ranker.tracing_observer import origin_traceparent
from services.ranker.transfer import chunks, encode
from services.ranker.transfer_wire import header_from_proto, header_to_proto
from services.ranker.warm import WARMING_UP, Warm, Warming

_PRE_INFER_OUTCOME = {
    outcome: common_pb2.PreInferOutcome.Value(f"PRE_INFER_OUTCOME_{outcome.name}")
    for outcome in PreInferOutcome
}
_CACHE_OUTCOME = {
    outcome: common_pb2.CacheOutcome.Value(f"CACHE_OUTCOME_{outcome.name}")
    for outcome in CacheOutcome
}


class RankerServicer(ranker_pb2_grpc.RankerServiceServicer):
    """Proto in, engine call, proto out; errors travel as RelayGRError to the interceptor.

    It answers from the start; until `warming` is ready (the model loaded and calibrated) every
    call is refused as UNAVAILABLE.
    """

    def __init__(self, warming: Warming, metrics: RankerMetrics | None = None) -> None:
        self._warming = warming
        self._metrics = metrics  # latency histograms; None: not measured

    @property
    def handoff(self) -> HandoffReceiving | None:
        """The receiving side of hand-offs; None while warming up (hand-offs refused)."""
        warm = self._warming.warm
        return None if warm is None else warm.handoff

    @staticmethod
    def _check_version(warm: Warm, asked: str) -> None:
        """A request naming another model version than this ranker's is never served here:
        FailedPrecondition naming both (empty: any, the router chose this ranker's)."""
        serving = warm.engine.model.model_version
        if asked and asked != serving:
            raise FailedPrecondition(
                f"this ranker serves model version {serving!r}, the request asks for {asked!r}"
            )

    async def PreInfer(
        self, request: common_pb2.PreInferRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.PreInferReply:
        start = time.perf_counter()
        warm = self._warming.get()
        self._check_version(warm, request.model_version)
        prefix = prefix_from_proto(request, warm.limits)
        window = request.relay_window_ms / 1e3 if request.relay_window_ms else None
        expected = request.rank_expected_in_ms / 1e3 if request.rank_expected_in_ms else None
        deadline = absolute_deadline(context.time_remaining(), time.monotonic())
        result = await warm.engine.pre_infer(prefix, window, deadline, expected)
        if self._metrics is not None:
            self._metrics.observe_pre_infer(result.outcome, time.perf_counter() - start)
        return common_pb2.PreInferReply(
            request_id=request.request_id,
            outcome=_PRE_INFER_OUTCOME[result.outcome],
            instance_id=warm.instance_id,
            model_version=result.key.model_version,
            prefix_digest=result.key.digest,
            prefix_tokens=result.tokens,
            kv_bytes=result.nbytes,
            server_ms=(time.perf_counter() - start) * 1e3,
        )

    async def Rank(
        self, request: common_pb2.RankRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.RankReply:
        start = time.perf_counter()
        warm = self._warming.get()
        self._check_version(warm, request.model_version)
        rank_input = rank_input_from_proto(request, warm.limits)
        deadline = absolute_deadline(context.time_remaining(), time.monotonic())
        result = await warm.engine.rank(rank_input, deadline)
        scores = result.scores.numpy()
        tasks = warm.engine.model.cfg.tasks
        if self._metrics is not None:
            self._metrics.observe_rank(result.outcome, time.perf_counter() - start)
        return common_pb2.RankReply(
            request_id=request.request_id,
            scores=[
                common_pb2.TaskScores(task=task, scores=scores[i]) for i, task in enumerate(tasks)
            ],
            cache_outcome=_CACHE_OUTCOME[result.outcome],
            instance_id=warm.instance_id,
            model_version=warm.engine.model.model_version,
            server_ms=(time.perf_counter() - start) * 1e3,
            computed_tokens=result.computed_tokens,
            relayed=result.relayed,
        )

    async def Fetch(
        self, request: ranker_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ranker_pb2.PrefixChunk]:
        """One entry held under exactly the key asked for, as a header and its payload.

        A streaming handler: the error interceptor passes it by, so it sets its own status.
        """
        if not (request.user_id and request.model_version and request.prefix_digest):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Fetch needs user_id, model_version and prefix_digest",
            )
        warm = self._warming.warm
        if warm is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, WARMING_UP)
        assert warm is not None
        key = CacheKey(
            UserId(request.user_id),
            ModelVersion(request.model_version),
            PrefixDigest(request.prefix_digest),
        )
        held = warm.engine.held_for_peer(key)
        if held is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no prefix of user {request.user_id!r} under that version and digest here",
            )
        assert held is not None
        kv, origin = held
        # Copying off the device and the content digest: off the event loop.
        header, payload = await asyncio.to_thread(encode, key, kv, origin_traceparent(origin))
        if self._metrics is not None:
            self._metrics.observe_fetch_served(header.nbytes)
        yield ranker_pb2.PrefixChunk(header=header_to_proto(header))
        for piece in chunks(payload):
            yield ranker_pb2.PrefixChunk(data=bytes(piece))

    async def Handoff(
        self,
        request_iterator: AsyncIterator[ranker_pb2.PrefixChunk],
        context: grpc.aio.ServicerContext,
    ) -> ranker_pb2.HandoffReply:
        # A streaming handler: the error interceptor passes it through, so it aborts itself.
        warm = self._warming.warm
        if warm is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "ranker takes no hand-offs now")
        assert warm is not None
        receiving, engine = warm.handoff, warm.engine
        if engine.draining:
            receiving.stats.refused_streams += 1
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "ranker is draining: hand off elsewhere"
            )
        if receiving.streams >= receiving.max_streams:
            receiving.stats.refused_streams += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{receiving.streams} hand-offs being received (handoff_max_streams)",
            )
        # Under mutual TLS the sender is the ranker its certificate names (authorization let
        # only rankers this far); the metadata the sender sets only names it in plaintext.
        certified = peer_identity(context)
        if certified is not None:
            sender = certified.instance
        else:
            sender = dict(context.invocation_metadata() or ()).get(SENDER_KEY, "")
        receiving.stats.received_from[sender] += 1
        model = engine.model
        intake = HandoffIntake(
            engine.core, model.cfg, model.model_version, model.device, receiving.stats,
            receiving.origin_of,
        )  # fmt: skip
        receiving.streams += 1
        # Under the RPC's server span when the interceptor made one, else a trace of its own.
        spanned = child_span if recording(receiving.tracer) else root_span
        try:
            with spanned(
                receiving.tracer,
                "ranker.handoff.receive",
                {
                    "relaygr.handoff.from": sender,
                    "relaygr.handoff.from_certified": certified is not None,
                },
            ):
                try:
                    async for chunk in request_iterator:
                        part = chunk.WhichOneof("part")
                        if part == "header":
                            intake.header(header_from_proto(chunk.header))
                        elif part == "data":
                            intake.data(chunk.data)
                except BaseException:
                    intake.abandon()
                    raise
                report = intake.end()
                annotate(
                    {
                        "relaygr.handoff.admitted": report.admitted,
                        "relaygr.handoff.refused": report.refused,
                        "relaygr.handoff.bytes": report.admitted_bytes,
                    }
                )
        finally:
            receiving.streams -= 1
        receiving.publish_later(report.users, sender)
        return ranker_pb2.HandoffReply(
            admitted=report.admitted,
            refused=report.refused,
            admitted_bytes=report.admitted_bytes,
            refusals=report.refusals,
        )

    async def Describe(
        self, request: ranker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> ranker_pb2.RankerInfo:
        warm = self._warming.get()
        engine = warm.engine
        cfg = engine.model.cfg
        core = engine.stats()
        cost = core.cost_model

        def usage(tier: Tier) -> ranker_pb2.TierUsage:
            u = core.tiers[tier]
            return ranker_pb2.TierUsage(
                budget_bytes=u.budget_bytes,
                used_bytes=u.used_bytes,
                pinned_bytes=u.pinned_bytes,
                entries=u.entries,
            )

        return ranker_pb2.RankerInfo(
            instance_id=warm.instance_id,
            model_version=engine.model.model_version,
            device=warm.device,
            dims=ranker_pb2.ModelDims(
                layers=cfg.num_layers,
                d_model=cfg.d_model,
                heads=cfg.num_heads,
                d_head=cfg.d_v,  # deprecated, as released
                tasks=list(cfg.tasks),
                kv_dtype=cfg.kv_dtype.value,
                max_user_features=cfg.max_user_features,
                max_history_tokens=cfg.max_history_tokens,
                max_candidates=cfg.max_candidates,
                kv_bytes_per_token=cfg.cache_bytes_per_token,  # deprecated, as released
                d_qk=cfg.d_qk,
                d_v=cfg.d_v,
                k_bytes_per_token=cfg.k_bytes_per_token,
                v_bytes_per_token=cfg.v_bytes_per_token,
                timestamp_bytes_per_token=TIMESTAMP_BYTES,
                cache_bytes_per_token=cfg.cache_bytes_per_token,
            ),
            hbm=usage(Tier.HBM),
            dram=usage(Tier.DRAM),
            cost_model=ranker_pb2.CostModel(
                fixed_ms=cost.fixed_ms,
                per_token_ms=cost.per_token_ms,
                per_pair_ms=cost.per_pair_ms,
                per_candidate_key_ms=cost.per_candidate_key_ms,
                reload_ms_per_mb=cost.reload_ms_per_mb,
                median_abs_rel_error=cost.median_abs_rel_error,
                samples=cost.samples,
                batch_saving_ms=cost.batch_saving_ms,
                batch_samples=cost.batch_samples,
                **cost.cached_terms(),
                **self._transfer_cost(engine),
            ),
            relay_enabled=engine.settings.relay_enabled,
            intra_op_threads=torch.get_num_threads(),
            queued_prefill_ms=core.queued_background_ms,
            queued_rank_ms=core.queued_rank_ms,
            relays_consumed=core.kv.relays_consumed,
            relays_expired_unconsumed=core.kv.relays_expired_unconsumed,
            relay_wait_p99_ms=core.relay_wait_p99_ms,
        )

    @staticmethod
    def _transfer_cost(engine: RankerEngine) -> dict[str, float]:
        """CostModel.transfer_* of the peer fetches in use (none: peer fetch is off)."""
        if engine.peer_fetch is None:
            return {}
        transfer = engine.peer_fetch.transfer
        return {"transfer_fixed_ms": transfer.fixed_ms, "transfer_ms_per_mb": transfer.ms_per_mb}
