"""Wires a TriggerConfig into a running trigger: etcd views, live config, dispatch, observation."""

import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from relaygr import service_names
from relaygr.aio import cancel_and_wait
from relaygr.balancing import replica_options
from relaygr.channel_renewal import RenewingChannel
from relaygr.etcd.membership_directory import EtcdMembershipDirectory
from relaygr.etcd.watch import Watch
from relaygr.grpc_server import GrpcServer
from relaygr.lifecycle import MeshLink, connect_mesh, serve, start_service_servers, stop_service
from relaygr.live_value import LiveValue, live_policy
from relaygr.metrics import MetricsServer
from relaygr.pool import RankerPool
from relaygr.room_poll import RoomPoller
from relaygr.service_main import service_main
from relaygr.telemetry import Telemetry
from relaygr.v1 import common_pb2, router_pb2_grpc, trigger_pb2_grpc
from relaygr.versions import VersionPolicy
from services.trigger.config import ENV_PREFIX, TriggerConfig
from services.trigger.dispatch import Dispatcher
from services.trigger.live_config import LiveConfig, live_config, live_config_key
from services.trigger.metrics import register_trigger_metrics
from services.trigger.policy import AdmissionPolicy
from services.trigger.service import TriggerServicer

_log = logging.getLogger("services.trigger")
SERVICE = "relaygr-trigger"  # the default OTEL service.name


@dataclass(slots=True)
class TriggerServer:
    """A running trigger (a `RunningService`): draining sends the admitted relays still queued."""

    server: GrpcServer
    servicer: TriggerServicer
    dispatcher: Dispatcher
    live_config: LiveConfig
    mesh: MeshLink
    pool: RankerPool
    router_channel: RenewingChannel
    tasks: list[asyncio.Task[None]]
    watch: Watch
    versions: LiveValue[VersionPolicy]  # the live version policy events are judged by
    versions_watch: Watch
    metrics_server: MetricsServer | None = None

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def cluster(self) -> EtcdMembershipDirectory:
        return self.mesh.cluster

    @property
    def metrics_port(self) -> int | None:
        """The bound `/metrics` port; None when metrics are not served."""
        return None if self.metrics_server is None else self.metrics_server.port

    async def drain(self, grace_s: float) -> None:
        """Let the relays queued when health turned NOT_SERVING go out within `grace_s`."""
        if not await self.dispatcher.drain(grace_s):
            _log.warning(
                "drain: %d relays still pending after %.1fs", self.dispatcher.pending(), grace_s
            )

    async def close(self) -> None:
        if self.metrics_server is not None:
            await self.metrics_server.close()
            self.metrics_server = None
        await cancel_and_wait(*self.tasks)
        await self.dispatcher.stop()
        await self.watch.cancel()
        await self.versions_watch.cancel()
        await self.mesh.close()
        await self.pool.close()
        await self.router_channel.close()

    async def stop(self, grace: float = 5.0) -> None:
        await stop_service(self, grace)


async def start_trigger(cfg: TriggerConfig, telemetry: Telemetry | None = None) -> TriggerServer:
    """Serve TriggerService; health turns SERVING once the etcd views, live config and version
    policy are read.

    `telemetry` (one per service; the caller shuts it down) traces and names where `/metrics`
    is served; by default nothing is traced and metrics are served at `cfg.metrics_address`.
    """
    telemetry = telemetry or Telemetry(SERVICE, metrics_address=cfg.metrics_address)
    options = cfg.server_options()
    mesh = connect_mesh(cfg)
    cluster = mesh.cluster
    interceptors = telemetry.client_interceptors()
    pool = RankerPool(options.message_args(), cfg, interceptors)
    # Every router the address resolves to (a list, or a headless Service), each one's health
    # watched: a router that begins to drain gets no new PreInfer (docs/reliability.md).
    router_channel = RenewingChannel(
        cfg.router_address,
        cfg,
        [*options.message_args(), *replica_options(service_names.ROUTER)],
        interceptors,
    )

    async def send(
        request: common_pb2.PreInferRequest, timeout_s: float
    ) -> common_pb2.PreInferReply:
        router = router_channel.stub(router_pb2_grpc.RouterServiceStub)
        reply: common_pb2.PreInferReply = await router.PreInfer(request, timeout=timeout_s)
        return reply

    policy = AdmissionPolicy(cfg)
    dispatcher = Dispatcher(send, cfg.dispatch_queue, cfg.dispatch_concurrency)
    servicer = TriggerServicer(policy, cluster, cluster, dispatcher, tracer=telemetry.tracer)
    register_trigger_metrics(
        telemetry.registry, servicer, dispatcher, cluster.view, lambda: mesh.etcd.connected
    )
    live = live_config(cfg, live_config_key(cfg.etcd_prefix), policy.reconfigure)
    versions = live_policy(cfg.etcd_prefix, servicer.use_versions, _log)
    server, metrics_server = await start_service_servers(
        cfg,
        "trigger",
        lambda s: trigger_pb2_grpc.add_TriggerServiceServicer_to_server(servicer, s),
        [service_names.TRIGGER],
        telemetry,
        _log,
    )
    await cluster.start()
    watch = await mesh.etcd.watch_prefix(live.key, live.on_event)
    versions_watch = await mesh.etcd.watch_prefix(versions.key, versions.on_event)
    dispatcher.start(servicer.on_outcome)
    poller = RoomPoller(
        policy.room, pool, cluster.view, cfg.observe_interval_ms / 1e3,
        tracer=telemetry.tracer, span_name="trigger.observe",
    )  # fmt: skip
    observe = asyncio.create_task(_observe(poller, pool), name="trigger-observe")
    await server.set_serving(True)
    _log.info(
        "trigger serving on port %d, mode %s, %d rankers in view",
        server.port,
        live.current.mode,
        len(cluster.view()),
    )
    return TriggerServer(
        server, servicer, dispatcher, live, mesh, pool, router_channel, [observe], watch,
        versions, versions_watch, metrics_server,
    )  # fmt: skip


async def _observe(poller: RoomPoller, pool: RankerPool) -> None:
    """Read every ranker's relay room (Describe) each interval; close departed rankers' channels.

    With tracing on, each round is one trace (`trigger.observe`) holding its Describe calls.
    """
    while True:
        view = await poller.poll_once()
        await pool.retain({r.address for r in view.values()}, grace_s=1.0)
        await asyncio.sleep(poller.interval_s)


async def _serve(cfg: TriggerConfig) -> None:
    await serve(cfg, "trigger", lambda telemetry: start_trigger(cfg, telemetry))


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        argv,
        prog="relaygr trigger",
        description="Trigger: decides at retrieval time which prefixes to pre-infer (relay).",
        config_cls=TriggerConfig,
        env_prefix=ENV_PREFIX,
        serve=_serve,
    )


if __name__ == "__main__":
    sys.exit(main())
