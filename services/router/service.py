"""RouterService: sends a user's PreInfer and Rank to the same ranker, over pooled channels."""

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from relaygr.cluster import Directory, Membership, PlacementRecord, RankerRecord
from relaygr.errors import Unavailable
from relaygr.router.load import WindowedLoad
from relaygr.router.placement import place, route_rank
from relaygr.router.pool import RankerPool
from relaygr.v1 import common_pb2, router_pb2_grpc

SERVICE_NAME = "relaygr.v1.RouterService"
_log = logging.getLogger("relaygr.router")

# A ranker answering these cannot serve this request now; another one can (by full inference
# at worst). Every other status is the caller's answer and passes through unchanged.
_TRY_NEXT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Places PreInfers by rendezvous hashing with bounded load and sends Ranks after them.

    The Rank path reads only local views (membership and directory are watched), never etcd.
    A placement is written to the directory only when the serving ranker is not the user's hash
    owner, so etcd writes follow spill-overs and membership changes, not the request rate. The
    load of a ranker is the PreInfers this router placed on it within the relay window.
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
    ) -> None:
        self._membership = membership
        self._directory = directory
        self._pool = pool
        self._epsilon = epsilon
        self._load_floor = load_floor
        self._window_s = relay_window_s
        self._clock = clock
        self.load = WindowedLoad(relay_window_s, clock)
        self.counters: Counter[str] = Counter()

    async def PreInfer(
        self, request: common_pb2.PreInferRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.PreInferReply:
        view = self._membership.view()
        user = request.user_id
        loads = self.load.loads()
        placement = place(user, view, loads, self._epsilon, self._hint(user), self._load_floor)
        if placement is None:
            raise Unavailable("no live ranker: none is registered in the membership view")
        reply, instance = await self._forward(placement.order, view, "PreInfer", request, context)
        self.load.add(instance)
        self.counters[f"placed_{placement.reason}"] += 1
        if placement.record or instance != placement.instance:  # not where hashing sends it
            await self._record(user, instance)
        return reply

    async def Rank(
        self, request: common_pb2.RankRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.RankReply:
        view = self._membership.view()
        order = route_rank(request.user_id, view, self._hint(request.user_id))
        if not order:
            raise Unavailable("no live ranker: none is registered in the membership view")
        reply, _ = await self._forward(order, view, "Rank", request, context)
        return reply

    def _hint(self, user: str) -> dict[str, str]:
        instance = self._directory.lookup(user)
        return {user: instance} if instance is not None else {}

    async def _forward(
        self,
        order: tuple[str, ...] | list[str],
        view: Mapping[str, RankerRecord],
        method: str,
        request: Any,
        context: grpc.aio.ServicerContext,
    ) -> tuple[Any, str]:
        """Call `method` on the first ranker in `order` that can serve it; honour the deadline."""
        tried: list[str] = []
        for instance in order:
            stub = self._pool.stub(view[instance].address)
            try:
                reply = await getattr(stub, method)(request, timeout=context.time_remaining())
                if tried:
                    self.counters[f"{method}_failed_over"] += 1
                return reply, instance
            except grpc.aio.AioRpcError as err:
                if err.code() not in _TRY_NEXT:
                    await context.abort(err.code(), err.details() or err.code().name)
                tried.append(f"{instance}: {err.code().name} {err.details()}")
        raise Unavailable(f"no ranker could serve {method}: " + "; ".join(tried))

    async def _record(self, user: str, instance: str) -> None:
        placement = PlacementRecord(user, instance, self._clock() + self._window_s)
        try:
            if await self._directory.record(placement, instance):
                self.counters["directory_writes"] += 1
        except Unavailable as err:  # etcd down: affinity may degrade, serving goes on
            self.counters["directory_write_failures"] += 1
            _log.warning("placement of %s on %s not recorded: %s", user, instance, err)
