"""RouterService: sends a user's PreInfer and Rank to the same ranker, over pooled channels.

The router reads only the user id and model version of a request (parsed as a `RoutingKey`)
and forwards the request's bytes, and the ranker's reply bytes, unparsed: the hop costs one
small parse, not a decode and re-encode of every behaviour array. Routing, retry and hedging
are the forwarder's (`services.router.forward`); this module translates gRPC to it and back,
and traces.
"""

import time
from collections.abc import Callable
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.trace import Tracer

from relaygr import service_names
from relaygr.cluster import Directory, Membership
from relaygr.errors import InvalidInput, ResourceExhausted, Unavailable
from relaygr.pool import RankerPool
from relaygr.room import RelayRoom
from relaygr.tracing import Attributes, annotate, child_span
from relaygr.v1 import router_pb2
from services.router.forward import Forwarder, ForwardSettings, RelayHint, RouterStats
from services.router.limits import RequestLimits, check_limits, packed_count
from services.router.load import WindowedLoad
from services.router.routes import CallFailed, Connect, Method, RankerCall, Refused, Route, Status

_KIND = {Method.PRE_INFER: "PreInferRequest", Method.RANK: "RankRequest"}


class RouterServicer:
    """RouterService on serialized messages: parse the routing key, forward, answer.

    Each request is routed by the `forwarder` and, when `tracer` is on, traced as a
    `router.route` span carrying the routing decision, under which the rankers are called and
    which records the ranker that served (instance, attempts, fallback). A refusal is the
    forwarder's status: UNAVAILABLE and RESOURCE_EXHAUSTED are raised as the shared errors, a
    ranker's own status passes through by `context.abort`.
    """

    def __init__(
        self,
        membership: Membership,
        directory: Directory,
        pool: RankerPool,
        settings: ForwardSettings,
        limits: RequestLimits | None = None,
        tracer: Tracer | None = None,
        clock: Callable[[], float] = time.time,
        draw: Callable[[int], int] | None = None,
        room: RelayRoom | None = None,
    ) -> None:
        """`limits` (None: none) bound a request's tokens and candidates before it is forwarded.
        `tracer` (None: off) traces each routing decision. `clock`, `draw` and `room`: see
        `Forwarder`."""
        self.forwarder = Forwarder(
            settings, membership, directory, ranker_calls(pool), clock, draw, room
        )
        self._limits = limits
        self._tracer = tracer

    @property
    def stats(self) -> RouterStats:
        return self.forwarder.stats

    @property
    def load(self) -> WindowedLoad:
        return self.forwarder.load

    def handler(self) -> grpc.GenericRpcHandler:
        """RouterService's methods on serialized messages (no deserializer, no serializer)."""
        return grpc.method_handlers_generic_handler(
            service_names.ROUTER,
            {
                "PreInfer": grpc.unary_unary_rpc_method_handler(self.PreInfer),
                "Rank": grpc.unary_unary_rpc_method_handler(self.Rank),
            },
        )

    async def PreInfer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._route(Method.PRE_INFER, request, context)

    async def Rank(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await self._route(Method.RANK, request, context)

    async def _route(
        self, method: Method, request: bytes, context: grpc.aio.ServicerContext
    ) -> bytes:
        key = _routing_key(request, _KIND[method], self._limits)
        hint = _hint(key) if method is Method.PRE_INFER else None
        route = self.forwarder.route(method, key.user_id, hint, key.model_version)
        if isinstance(route, Refused):
            await _refuse(route, context)
        with child_span(self._tracer, "router.route", _decision(route)):
            outcome = await self.forwarder.forward(route, request, context.time_remaining)
            if isinstance(outcome, Refused):
                await _refuse(outcome, context)
            if self._tracer is not None:
                annotate(
                    {
                        "relaygr.placement.instance": outcome.instance,
                        "relaygr.placement.attempts": outcome.attempts,
                        "relaygr.placement.fallback": outcome.fallback,
                    }
                )
        await self.forwarder.settle(route, outcome)
        return outcome.reply


def ranker_calls(pool: RankerPool) -> Connect:
    """The forwarder's calls to rankers over `pool`'s channels; a ranker's gRPC error comes
    back as `CallFailed`."""

    def connect(address: str, method: Method) -> RankerCall:
        raw = pool.call(address, method)

        async def call(request: bytes, timeout: float | None) -> bytes | CallFailed:
            try:
                return await raw(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                return CallFailed(Status[err.code().name], err.details())

        return call

    return connect


def _decision(route: Route) -> Attributes:
    """The routing decision as the `router.route` span's attributes."""
    if route.reason is None:
        return {"relaygr.placement.reason": "random", "relaygr.model_version": route.model_version}
    decision: dict[str, str] = {
        "relaygr.user_id": route.user,
        "relaygr.model_version": route.model_version,
        "relaygr.placement.reason": route.reason.value,
    }
    if route.placement is not None:
        decision["relaygr.placement.owner"] = route.placement.owner
        decision["relaygr.placement.first"] = route.placement.instance
    return decision


async def _refuse(refused: Refused, context: grpc.aio.ServicerContext) -> NoReturn:
    """Answer the caller with the forwarder's refusal."""
    if refused.status is Status.UNAVAILABLE:
        raise Unavailable(refused.message)
    if refused.status is Status.RESOURCE_EXHAUSTED:
        raise ResourceExhausted(refused.message)
    await context.abort(grpc.StatusCode[refused.status.name], refused.message)
    raise AssertionError("context.abort returned")  # it raises AbortError


def _hint(key: router_pb2.RoutingKey) -> RelayHint:
    """Where a PreInfer (parsed as a RoutingKey) should land, and its prefix tokens."""
    tokens = packed_count(key.user_features) + packed_count(key.long_term.item_ids)
    return RelayHint(key.preferred_instance, tokens)


def _routing_key(request: bytes, kind: str, limits: RequestLimits | None) -> router_pb2.RoutingKey:
    """A serialized PreInferRequest or RankRequest parsed as a RoutingKey (the user id is field
    2 of both, the model version field 9), once the request is known to be within `limits`."""
    key = router_pb2.RoutingKey()
    try:
        key.ParseFromString(request)
    except DecodeError as err:
        raise InvalidInput(f"request is not a valid {kind}: {err}") from err
    if limits is not None:
        check_limits(key, limits)
    return key
