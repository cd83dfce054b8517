"""A mesh on loopback: real etcd (fixture), in-process rankers registered in it, routers."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace

import grpc

from relaygr.ranker.model import RankingModel
from relaygr.ranker.server import RankerServer, start_ranker
from relaygr.router.config import RouterConfig
from relaygr.router.server import RouterServer, start_router
from relaygr.trigger.config import TriggerConfig
from relaygr.trigger.server import TriggerServer, start_trigger
from relaygr.v1 import router_pb2_grpc, trigger_pb2_grpc
from tests.integration.ranker_harness import BASE, COST, poll


@dataclass(slots=True)
class Mesh:
    endpoint: str
    model: RankingModel
    rankers: dict[str, RankerServer] = field(default_factory=dict)
    routers: list[RouterServer] = field(default_factory=list)
    triggers: list[TriggerServer] = field(default_factory=list)
    stubs: list[router_pb2_grpc.RouterServiceStub] = field(default_factory=list)
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    async def add_ranker(self, instance_id: str, **config: object) -> RankerServer:
        cfg = replace(
            BASE, instance_id=instance_id, etcd_endpoints=(self.endpoint,), lease_ttl_s=2.0,
            **config,
        )  # type: ignore[arg-type]  # fmt: skip
        ranker = await start_ranker(cfg, model=self.model, cost_model=COST)
        self.rankers[instance_id] = ranker
        await self.converged()
        return ranker

    async def add_router(
        self, converge: bool = True, **config: object
    ) -> router_pb2_grpc.RouterServiceStub:
        cfg = RouterConfig(listen="127.0.0.1:0", etcd_endpoints=(self.endpoint,), **config)  # type: ignore[arg-type]
        router = await start_router(cfg)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
        self.routers.append(router)
        self.channels.append(channel)
        self.stubs.append(router_pb2_grpc.RouterServiceStub(channel))
        if converge:  # rankers of other processes are not in `rankers`
            await self.converged()
        return self.stubs[-1]

    async def add_trigger(self, **config: object) -> trigger_pb2_grpc.TriggerServiceStub:
        """A trigger relaying through the first router (add one first)."""
        defaults = {"router_address": f"127.0.0.1:{self.routers[0].port}"}
        cfg = TriggerConfig(
            listen="127.0.0.1:0", etcd_endpoints=(self.endpoint,), **{**defaults, **config}
        )  # type: ignore[arg-type]
        trigger = await start_trigger(cfg)
        self.triggers.append(trigger)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{trigger.port}")
        self.channels.append(channel)
        live = set(self.rankers)
        await poll(lambda: set(trigger.cluster.view()) == live)
        return trigger_pb2_grpc.TriggerServiceStub(channel)

    async def converged(self) -> None:
        """Every router and trigger sees exactly the live rankers."""
        live = set(self.rankers)
        await poll(
            lambda: all(set(s.cluster.view()) == live for s in [*self.routers, *self.triggers])
        )

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        for trigger in self.triggers:
            await trigger.stop(grace=0.5)
        for router in self.routers:
            await router.stop(grace=0.5)
        for ranker in self.rankers.values():
            await ranker.stop(grace=0.5)


@asynccontextmanager
async def running_mesh(endpoint: str, model: RankingModel) -> AsyncIterator[Mesh]:
    async with AsyncExitStack() as stack:
        mesh = Mesh(endpoint, model)
        stack.push_async_callback(mesh.close)
        yield mesh


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]
