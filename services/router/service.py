"""RouterService: sends a user's PreInfer and Rank to the same ranker, over pooled channels.

The router reads only the user id of a request (parsed as a `RoutingKey`) and forwards the
request's bytes, and the ranker's reply bytes, unparsed: the hop costs one small parse, not a
decode and re-encode of every behaviour array.
"""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.trace import Tracer

from relaygr.cluster import Directory, Membership, PlacementRecord, RankerRecord
from relaygr.errors import InvalidInput, ResourceExhausted, Unavailable
from relaygr.placement import directory_write, place, route_rank, shuffled
from relaygr.pool import RankerPool
from relaygr.tracing import annotate, child_span
from relaygr.v1 import router_pb2
from services.router.limits import RequestLimits, check_limits
from services.router.load import WindowedLoad

SERVICE_NAME = "relaygr.v1.RouterService"
_log = logging.getLogger("services.router")

# A ranker answering these cannot serve this request now; another one can (by full inference
# at worst). Every other status is the caller's answer and passes through unchanged.
_TRY_NEXT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
_NO_RANKER = "no live ranker: none is registered in the membership view"


class RouterServicer:
    """Places PreInfers by rendezvous hashing with bounded load and sends Ranks after them.

    The Rank path reads only local views (membership and directory are watched), never etcd.
    A placement is written to the directory only when the serving ranker is not the user's hash
    owner and the directory does not already say so for at least half a relay window (see
    `directory_write`), so etcd writes follow spill-overs and membership changes, not the
    request rate. The load of a ranker is the PreInfers this router placed on it within the
    relay window.
    """

    def __init__(
        self,
        membership: Membership,
        directory: Directory,
        pool: RankerPool,
        epsilon: float,
        load_floor: float,
        relay_window_s: float,
        clock: Callable[[], float] = time.time,
        randomly: Callable[[int], int] | None = None,
        limits: RequestLimits | None = None,
        tracer: Tracer | None = None,
        rank_hedge_s: float | None = None,
    ) -> None:
        """`randomly` (an int in [0, n) per call) turns affinity off: the placement ablation.
        `limits` (None: none) bound a request's tokens and candidates before it is forwarded.
        `tracer` (None: off) traces each routing decision as a `router.route` span.
        `rank_hedge_s` (None: never) sends a Rank unanswered that long to the next ranker too."""
        self._tracer = tracer
        self._rank_hedge_s = rank_hedge_s
        self._randomly = randomly
        self._limits = limits
        self._membership = membership
        self._directory = directory
        self._pool = pool
        self._epsilon = epsilon
        self._load_floor = load_floor
        self._window_s = relay_window_s
        self._clock = clock
        self.load = WindowedLoad(relay_window_s, clock)
        self.counters: Counter[str] = Counter()
        # Ranks by where their order came from: "directory" or "hash" (PreInfers: `counters`).
        self.rank_routes: Counter[str] = Counter()
        # Every call to a ranker by (method, status code name), failed-over attempts included.
        self.forwarded: Counter[tuple[str, str]] = Counter()

    def handler(self) -> grpc.GenericRpcHandler:
        """RouterService's methods on serialized messages (no deserializer, no serializer)."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "PreInfer": grpc.unary_unary_rpc_method_handler(self.PreInfer),
                "Rank": grpc.unary_unary_rpc_method_handler(self.Rank),
            },
        )

    async def PreInfer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        view = self._membership.view()
        user = _user_id(request, "PreInferRequest", self._limits)
        if self._randomly is not None:
            return await self._forward_randomly(view, "PreInfer", request, context)
        entry = self._directory.entry(user)
        hint = {} if entry is None else {user: entry.instance_id}
        loads = self.load.loads()
        placement = place(user, view, loads, self._epsilon, hint, self._load_floor)
        if placement is None:
            raise Unavailable(_NO_RANKER)
        decision = {
            "relaygr.user_id": user,
            "relaygr.placement.reason": placement.reason.value,
            "relaygr.placement.owner": placement.owner,
        }
        with child_span(self._tracer, "router.route", decision):
            reply, instance = await self._forward(
                placement.order, view, "PreInfer", request, context
            )
        self.load.add(instance)
        self.counters[f"placed_{placement.reason}"] += 1
        known = None if entry is None else (entry.instance_id, entry.expires_at)
        if directory_write(instance, placement.owner, known, self._clock(), self._window_s):
            await self._record(user, instance)
        return reply

    async def Rank(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        view = self._membership.view()
        user = _user_id(request, "RankRequest", self._limits)
        if self._randomly is not None:
            return await self._forward_randomly(view, "Rank", request, context)
        instance = self._directory.lookup(user)
        order = route_rank(user, view, {} if instance is None else {user: instance})
        reason = "directory" if order and order[0] == instance else "hash"
        self.rank_routes[reason] += 1
        decision = {"relaygr.user_id": user, "relaygr.placement.reason": reason}
        with child_span(self._tracer, "router.route", decision):
            reply, _ = await self._forward(
                order, view, "Rank", request, context, self._rank_hedge_s
            )
        return reply

    async def _forward(
        self,
        order: tuple[str, ...] | list[str],
        view: Mapping[str, RankerRecord],
        method: str,
        request: bytes,
        context: grpc.aio.ServicerContext,
        hedge_after_s: float | None = None,
    ) -> tuple[bytes, str]:
        """Call `method` on the first ranker in `order` that can serve it; honour the deadline.

        With `hedge_after_s`, a call unanswered that long is also sent to the next ranker in
        `order` (once); the first reply wins and the other call is cancelled, so a frozen ranker
        costs a miss rather than the caller's deadline. When none can serve: RESOURCE_EXHAUSTED
        if every ranker tried refused for want of room (the request is too large or too heavy
        for all of them), else UNAVAILABLE; the message lists each ranker's answer. An empty
        `order` (no live ranker) is UNAVAILABLE.
        """
        if not order:
            raise Unavailable(_NO_RANKER)
        refusals: list[tuple[str, grpc.aio.AioRpcError]] = []
        if hedge_after_s is None:  # one call at a time: no task or timer on the common path
            for attempt, instance in enumerate(order, 1):
                call = self._pool.call(view[instance].address, method)
                try:
                    reply = await call(request, timeout=context.time_remaining())
                except grpc.aio.AioRpcError as err:
                    await self._refused(method, instance, err, context, refusals)
                    continue
                return reply, self._served(method, order, instance, attempt)
        else:
            served = await self._hedged(order, view, method, request, context, hedge_after_s)
            if isinstance(served, tuple):
                return served
            refusals = served
        message = f"no ranker could serve {method}: " + "; ".join(
            f"{instance}: {err.code().name} {err.details()}" for instance, err in refusals
        )
        if {err.code() for _, err in refusals} == {grpc.StatusCode.RESOURCE_EXHAUSTED}:
            raise ResourceExhausted(message)
        raise Unavailable(message)

    async def _hedged(
        self,
        order: tuple[str, ...] | list[str],
        view: Mapping[str, RankerRecord],
        method: str,
        request: bytes,
        context: grpc.aio.ServicerContext,
        hedge_after_s: float,
    ) -> tuple[bytes, str] | list[tuple[str, grpc.aio.AioRpcError]]:
        """`_forward` with one hedge: (reply, instance) of the first reply, else the refusals."""
        waiting = list(order)
        calls: dict[asyncio.Future[bytes], str] = {}

        def launch() -> None:
            instance = waiting.pop(0)
            call = self._pool.call(view[instance].address, method)
            calls[asyncio.ensure_future(call(request, timeout=context.time_remaining()))] = instance

        refusals: list[tuple[str, grpc.aio.AioRpcError]] = []
        hedged = False
        launch()
        try:
            while calls:
                hedge_now = not hedged and bool(waiting)
                done, _ = await asyncio.wait(
                    calls,
                    timeout=hedge_after_s if hedge_now else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:  # the call outlived the hedge delay: ask the next ranker too
                    hedged = True
                    self.counters[f"{method}_hedged"] += 1
                    launch()
                    continue
                for finished in done:
                    instance = calls.pop(finished)
                    try:
                        reply = finished.result()
                    except grpc.aio.AioRpcError as err:
                        await self._refused(method, instance, err, context, refusals)
                        continue
                    return reply, self._served(method, order, instance, len(order) - len(waiting))
                if not calls and waiting:
                    launch()
        finally:
            for call in calls:
                call.cancel()
        return refusals

    async def _refused(
        self,
        method: str,
        instance: str,
        err: grpc.aio.AioRpcError,
        context: grpc.aio.ServicerContext,
        refusals: list[tuple[str, grpc.aio.AioRpcError]],
    ) -> None:
        """Count a ranker's error; pass it to the caller unless another ranker may serve."""
        self.forwarded[method, err.code().name] += 1
        if err.code() not in _TRY_NEXT:
            await context.abort(err.code(), err.details() or err.code().name)
        refusals.append((instance, err))

    def _served(
        self, method: str, order: tuple[str, ...] | list[str], instance: str, attempts: int
    ) -> str:
        """Count and annotate a reply from `instance` after `attempts` calls; return it."""
        self.forwarded[method, "OK"] += 1
        if instance != order[0]:
            self.counters[f"{method}_failed_over"] += 1
        if self._tracer is not None:
            annotate(
                {
                    "relaygr.placement.instance": instance,
                    "relaygr.placement.attempts": attempts,
                    "relaygr.placement.fallback": instance != order[0],
                }
            )
        return instance

    async def _forward_randomly(
        self,
        view: Mapping[str, RankerRecord],
        method: str,
        request: bytes,
        context: grpc.aio.ServicerContext,
    ) -> bytes:
        assert self._randomly is not None
        with child_span(self._tracer, "router.route", {"relaygr.placement.reason": "random"}):
            reply, _ = await self._forward(
                shuffled(view, self._randomly), view, method, request, context
            )
        self.counters[f"placed_random_{method}"] += 1
        return reply

    async def _record(self, user: str, instance: str) -> None:
        placement = PlacementRecord(user, instance, self._clock() + self._window_s)
        try:
            if await self._directory.record(placement, instance):
                self.counters["directory_writes"] += 1
        except Unavailable as err:  # etcd down: affinity may degrade, serving goes on
            self.counters["directory_write_failures"] += 1
            _log.warning("placement of %s on %s not recorded: %s", user, instance, err)


def _user_id(request: bytes, kind: str, limits: RequestLimits | None) -> str:
    """The user id of a serialized PreInferRequest or RankRequest (field 2 of both), once the
    request is known to be within `limits`."""
    key = router_pb2.RoutingKey()
    try:
        key.ParseFromString(request)
    except DecodeError as err:
        raise InvalidInput(f"request is not a valid {kind}: {err}") from err
    if limits is not None:
        check_limits(key, limits)
    return key.user_id
