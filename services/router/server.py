"""Wires a RouterConfig into a running router: etcd views, ranker channels, gRPC server."""

import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from relaygr import service_names
from relaygr.aio import cancel_and_wait
from relaygr.errors import Unavailable
from relaygr.etcd.membership_directory import EtcdMembershipDirectory
from relaygr.etcd.watch import Watch
from relaygr.grpc_server import GrpcServer
from relaygr.lifecycle import MeshLink, connect_mesh, serve, start_service_servers, stop_service
from relaygr.live_value import LiveValue, live_policy
from relaygr.metrics import MetricsServer
from relaygr.pool import RankerPool
from relaygr.room import RelayRoom
from relaygr.room_poll import RoomPoller
from relaygr.service_main import service_main
from relaygr.telemetry import Telemetry
from relaygr.versions import VersionPolicy
from services.router.config import ENV_PREFIX, RouterConfig
from services.router.limits import RequestLimits
from services.router.metrics import register_router_metrics
from services.router.service import RouterServicer

_CLOSE_GRACE_S = 5.0  # calls in flight to a departed ranker may finish (they have deadlines)
_log = logging.getLogger("services.router")
SERVICE = "relaygr-router"  # the default OTEL service.name


@dataclass(slots=True)
class RouterServer:
    """A running router (a `RunningService`): nothing to drain, its RPCs end with the server."""

    server: GrpcServer
    servicer: RouterServicer
    mesh: MeshLink
    pool: RankerPool
    maintenance: asyncio.Task[None]
    versions: LiveValue[VersionPolicy]  # the live version policy the forwarder routes by
    versions_watch: Watch
    metrics_server: MetricsServer | None = None
    poller: RoomPoller | None = None  # reads rankers' relay room (None: observe_interval_ms 0)
    observe: asyncio.Task[None] | None = None

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
        """Nothing queued here: the RPCs in flight finish as the server stops."""

    async def close(self) -> None:
        if self.metrics_server is not None:
            await self.metrics_server.close()
            self.metrics_server = None
        await cancel_and_wait(self.maintenance, self.observe)
        await self.versions_watch.cancel()
        await self.mesh.close()
        await self.pool.close()

    async def stop(self, grace: float = 5.0) -> None:
        await stop_service(self, grace)


async def start_router(cfg: RouterConfig, telemetry: Telemetry | None = None) -> RouterServer:
    """Serve RouterService; health turns SERVING once the etcd views and the live version
    policy are loaded.

    `telemetry` (one per service; the caller shuts it down) traces and names where `/metrics`
    is served; by default nothing is traced and metrics are served at `cfg.metrics_address`.
    """
    telemetry = telemetry or Telemetry(SERVICE, metrics_address=cfg.metrics_address)
    options = cfg.server_options()
    mesh = connect_mesh(cfg)
    cluster = mesh.cluster
    pool = RankerPool(options.message_args(), cfg, telemetry.client_interceptors())
    settings = cfg.forward_settings()
    limits = RequestLimits(cfg.max_tokens, cfg.max_candidates)
    clock = time.time  # the forwarder's: directory expiry, load window, relay room
    room = RelayRoom(settings.relay_window_s, settings.refusal_s)
    servicer = RouterServicer(
        cluster, cluster, pool, settings, limits, telemetry.tracer, clock, room=room
    )
    register_router_metrics(telemetry.registry, servicer, cluster.view, lambda: mesh.etcd.connected)
    if settings.random_placement:
        _log.warning("placement is RANDOM: PreInfer and Rank ignore affinity (ablation only)")
    server, metrics_server = await start_service_servers(
        cfg,
        "router",
        lambda s: s.add_generic_rpc_handlers((servicer.handler(),)),
        [service_names.ROUTER],
        telemetry,
        _log,
    )
    await cluster.start()
    versions = live_policy(cfg.etcd_prefix, servicer.forwarder.use_versions, _log)
    versions_watch = await mesh.etcd.watch_prefix(versions.key, versions.on_event)
    await server.set_serving(True)
    _log.info("router serving on port %d, %d rankers in view", server.port, len(cluster.view()))
    window_s = cfg.relay_window_ms / 1e3
    maintenance = asyncio.create_task(_maintain(cluster, pool, window_s), name="router-maintenance")
    poller = observe = None
    if cfg.observe_interval_ms:
        poller = RoomPoller(
            room, pool, cluster.view, cfg.observe_interval_ms / 1e3, clock,
            telemetry.tracer, "router.observe",
        )  # fmt: skip
        observe = asyncio.create_task(poller.run(), name="router-observe")
    return RouterServer(
        server, servicer, mesh, pool, maintenance, versions, versions_watch, metrics_server,
        poller, observe,
    )  # fmt: skip


async def _maintain(cluster: EtcdMembershipDirectory, pool: RankerPool, window_s: float) -> None:
    """Every relay window: delete expired directory entries, close departed rankers' channels.

    Entries this router wrote are purged once expired; others' once expired for ten windows
    (their writer is presumably gone). While etcd is down purging waits for the next round.
    """
    while True:
        await asyncio.sleep(max(window_s, 1.0))
        live = {record.address for record in cluster.view().values()}
        await pool.retain(live, grace_s=_CLOSE_GRACE_S)
        try:
            await cluster.purge_expired(others_after_s=10 * window_s)
        except Unavailable as err:
            _log.warning("directory purge deferred: %s", err)


async def _serve(cfg: RouterConfig) -> None:
    await serve(cfg, "router", lambda telemetry: start_router(cfg, telemetry))


def main(argv: Sequence[str] | None = None) -> int:
    return service_main(
        argv,
        prog="relaygr router",
        description="Router: sends each user's PreInfer and Rank to the same ranker.",
        config_cls=RouterConfig,
        env_prefix=ENV_PREFIX,
        serve=_serve,
    )


if __name__ == "__main__":
    sys.exit(main())
