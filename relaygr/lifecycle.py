"""The lifecycle every service shares: its servers, its link to the mesh, and one serve loop
(SIGTERM or SIGINT: health NOT_SERVING, a linger, drain, stop the gRPC server, close, in that
order)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from relaygr.authz_grpc import authorizer, refusal_metrics
from relaygr.errors import ConfigError
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.membership_directory import EtcdMembershipDirectory
from relaygr.grpc_server import GrpcServer, drain, install_drain_handlers, start_server
from relaygr.metrics import LiveCollector, MetricsServer, start_metrics_server
from relaygr.service_options import ServiceOptions
from relaygr.telemetry import Telemetry
from relaygr.tls import log_transport, server_credentials


class RunningService(Protocol):
    """A started service, shut down once by `stop_service` (or `serve` on a signal).

    Shutdown order, the same for every service: health turns NOT_SERVING for good (probes and
    balancers stop sending; on a signal, `health_linger_s` of serving on lets callers that
    watch health move away), then `drain(grace_s)`, then the gRPC server stops (RPCs in flight
    get up to `grace_s`), then `close()`.
    """

    @property
    def server(self) -> GrpcServer: ...

    @property
    def port(self) -> int: ...

    async def drain(self, grace_s: float) -> None:
        """Stop taking new work and finish what is queued; health already says NOT_SERVING."""

    async def close(self) -> None:
        """Release what the service holds (tasks, mesh link, channels, `/metrics`) once its
        gRPC server has stopped."""


async def stop_service(service: RunningService, grace_s: float, linger_s: float = 0.0) -> None:
    """Shut `service` down in the order `RunningService` states; `linger_s` as on a signal."""
    await drain(service.server, grace_s, lambda: service.drain(grace_s), linger_s)
    await service.close()


async def serve(
    cfg: ServiceOptions,
    name: str,
    start: Callable[[Telemetry], Awaitable[RunningService]],
    instance_id: str = "",
) -> None:
    """Run the service `start` builds until SIGTERM or SIGINT, then shut it down.

    Telemetry (OTEL_* from the environment, `/metrics` at `cfg.metrics_address`) is named
    `relaygr-<name>`; its batched spans are flushed however the service ends.
    """
    telemetry = Telemetry.from_env(f"relaygr-{name}", os.environ, cfg.metrics_address, instance_id)
    try:
        service = await start(telemetry)
        print(f"relaygr {name} listening on port {service.port}", flush=True)
        grace_s = cfg.drain_grace_s
        await install_drain_handlers(
            asyncio.get_running_loop(),
            service.server,
            grace_s,
            lambda: service.drain(grace_s),
            cfg.health_linger_s,
        )
        await service.close()
    finally:
        await asyncio.to_thread(telemetry.shutdown)  # the spans still batched go out


async def start_service_servers(
    cfg: ServiceOptions,
    service: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    telemetry: Telemetry,
    log: logging.Logger,
) -> tuple[GrpcServer, MetricsServer | None]:
    """The service's gRPC server on `cfg.listen` (health NOT_SERVING until the caller says) and
    its `/metrics` server where `telemetry` names one; neither is left running if one fails."""
    log_transport(cfg, service, log)
    authz = authorizer(cfg)
    if authz is not None:
        log.info("%s authorizes each call by the caller's role (docs/security.md)", service)
        stats = authz.stats
        telemetry.registry.register(LiveCollector(lambda: refusal_metrics(stats)))
    server = await start_server(
        cfg.listen,
        register,
        service_names,
        cfg.server_options(),
        server_credentials(cfg),
        interceptors=telemetry.server_interceptors(),
        authz=authz,
    )
    if telemetry.metrics_address is None:
        return server, None
    try:
        return server, await start_metrics_server(telemetry.registry, telemetry.metrics_address)
    except ConfigError:
        await server.stop(0)
        raise


@dataclass(frozen=True, slots=True)
class MeshLink:
    """One process's link to the mesh: its etcd client, and the membership and directory kept
    in etcd through it (views followed only once `cluster.start()` is awaited)."""

    etcd: EtcdClient
    cluster: EtcdMembershipDirectory

    async def close(self) -> None:
        """Stop following the views, then close the client (its watches and kept leases end
        without revoking: a registration not withdrawn lapses with its lease)."""
        await self.cluster.stop()
        await self.etcd.close()


def connect_mesh(cfg: ServiceOptions) -> MeshLink:
    """The one way a service reaches the mesh: etcd at `cfg.etcd_endpoints` with its etcd
    security settings, keys under `cfg.etcd_prefix`. Nothing is dialled until first used."""
    etcd = EtcdClient(cfg.etcd_endpoints, security=cfg.etcd_security())
    return MeshLink(etcd, EtcdMembershipDirectory(etcd, prefix=cfg.etcd_prefix))
