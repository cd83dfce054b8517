"""A mesh on loopback: real etcd (fixture), in-process rankers registered in it, routers and
triggers; each service optionally traced and serving metrics (test_observability.py)."""

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace

import grpc

from relaygr.authz import Role
from relaygr.telemetry import Telemetry
from relaygr.tls import open_channel
from relaygr.tls_settings import PLAINTEXT, ClientTls
from relaygr.v1 import router_pb2_grpc, trigger_pb2_grpc
from services.ranker.model import RankingModel
from services.ranker.server import RankerServer, start_ranker
from services.router.config import RouterConfig
from services.router.server import RouterServer, start_router
from services.trigger.config import TriggerConfig
from services.trigger.server import TriggerServer, start_trigger
from tests.integration.ranker_harness import BASE, COST, poll
from tooling.local.certs import Pki


def transport(pki: Pki | None, role: Role, instance: str) -> dict[str, object]:
    """Service config fields for mutual TLS with the identity `role`/`instance` of `pki`, or
    for plaintext."""
    if pki is None:
        return {"plaintext": True}
    leaf = pki.identity(role, instance)
    return {
        "plaintext": False, "tls_cert": leaf.cert, "tls_key": leaf.key, "tls_ca": pki.ca_cert,
        "trust_domain": pki.trust_domain,
    }  # fmt: skip


@dataclass(slots=True)
class Mesh:
    """Services started in this process, stopped by `close` in reverse order of kind (triggers,
    routers, rankers), then their telemetry shut down. `stubs[i]` dials `routers[i]`,
    `trigger_stubs[i]` dials `triggers[i]`."""

    endpoint: str
    model: RankingModel
    pki: Pki | None = None  # every service and the harness's channels over mutual TLS
    # Each service gets a Telemetry built from this OTEL_* environment (None: no tracing) ...
    telemetry_env: Mapping[str, str] | None = None
    serve_metrics: bool = False  # ... and serves /metrics on a free port (`metrics_port`)
    rankers: dict[str, RankerServer] = field(default_factory=dict)
    routers: list[RouterServer] = field(default_factory=list)
    triggers: list[TriggerServer] = field(default_factory=list)
    stubs: list[router_pb2_grpc.RouterServiceStub] = field(default_factory=list)
    trigger_stubs: list[trigger_pb2_grpc.TriggerServiceStub] = field(default_factory=list)
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    telemetry: list[Telemetry] = field(default_factory=list)

    def _telemetry(self, service: str) -> Telemetry | None:
        """A service's own Telemetry, or None (the server's default: nothing traced)."""
        if self.telemetry_env is None and not self.serve_metrics:
            return None
        telemetry = Telemetry.from_env(service, self.telemetry_env or {})
        if self.serve_metrics:
            telemetry.metrics_address = ("127.0.0.1", 0)
        self.telemetry.append(telemetry)
        return telemetry

    async def add_ranker(
        self, instance_id: str, ranking_model: RankingModel | None = None, **config: object
    ) -> RankerServer:
        """A ranker serving `ranking_model` (None: the mesh's `model`)."""
        cfg = replace(
            BASE, instance_id=instance_id, etcd_endpoints=(self.endpoint,),
            **{"lease_ttl_s": 2.0, **transport(self.pki, Role.RANKER, instance_id), **config},
        )  # type: ignore[arg-type]  # fmt: skip
        ranker = await start_ranker(
            cfg,
            model=ranking_model or self.model,
            cost_model=COST,
            telemetry=self._telemetry("relaygr-ranker"),
        )
        self.rankers[instance_id] = ranker
        await self.converged()
        return ranker

    async def add_router(
        self, converge: bool = True, **config: object
    ) -> router_pb2_grpc.RouterServiceStub:
        cfg = RouterConfig(
            listen="127.0.0.1:0", etcd_endpoints=(self.endpoint,),
            **{**transport(self.pki, Role.ROUTER, f"router-{len(self.routers)}"), **config},
        )  # type: ignore[arg-type]  # fmt: skip
        router = await start_router(cfg, self._telemetry("relaygr-router"))
        channel = open_channel(f"127.0.0.1:{router.port}", self.client)
        self.routers.append(router)
        self.channels.append(channel)
        self.stubs.append(router_pb2_grpc.RouterServiceStub(channel))
        if converge:  # rankers of other processes are not in `rankers`
            await self.converged()
        return self.stubs[-1]

    async def add_trigger(self, **config: object) -> trigger_pb2_grpc.TriggerServiceStub:
        """A trigger relaying through the first router (add one first)."""
        defaults = {
            "router_address": f"127.0.0.1:{self.routers[0].port}",
            **transport(self.pki, Role.TRIGGER, f"trigger-{len(self.triggers)}"),
        }
        cfg = TriggerConfig(
            listen="127.0.0.1:0", etcd_endpoints=(self.endpoint,), **{**defaults, **config}
        )  # type: ignore[arg-type]
        trigger = await start_trigger(cfg, self._telemetry("relaygr-trigger"))
        self.triggers.append(trigger)
        channel = open_channel(f"127.0.0.1:{trigger.port}", self.client)
        self.channels.append(channel)
        self.trigger_stubs.append(trigger_pb2_grpc.TriggerServiceStub(channel))
        live = set(self.rankers)
        await poll(lambda: set(trigger.cluster.view()) == live)
        return self.trigger_stubs[-1]

    @property
    def client(self) -> ClientTls:
        """How the harness (a caller outside the mesh) dials the services."""
        return self.pki.client() if self.pki is not None else PLAINTEXT

    async def converged(self) -> None:
        """Every router and trigger sees exactly the live rankers."""
        live = set(self.rankers)
        await poll(
            lambda: all(set(s.cluster.view()) == live for s in [*self.routers, *self.triggers])
        )

    async def flush(self) -> None:
        """Export every span ended so far (the exporters block: off the event loop)."""
        for telemetry in self.telemetry:
            if telemetry.tracer_provider is not None:
                await asyncio.to_thread(telemetry.tracer_provider.force_flush)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        for trigger in self.triggers:
            await trigger.stop(grace=0.5)
        for router in self.routers:
            await router.stop(grace=0.5)
        for ranker in self.rankers.values():
            await ranker.stop(grace=0.5)
        for telemetry in self.telemetry:
            await asyncio.to_thread(telemetry.shutdown)


@asynccontextmanager
async def running_mesh(
    endpoint: str,
    model: RankingModel,
    pki: Pki | None = None,
    *,
    telemetry_env: Mapping[str, str] | None = None,
    serve_metrics: bool = False,
) -> AsyncIterator[Mesh]:
    """An empty `Mesh` (add its services), closed on the way out."""
    async with AsyncExitStack() as stack:
        mesh = Mesh(endpoint, model, pki, telemetry_env, serve_metrics)
        stack.push_async_callback(mesh.close)
        yield mesh
