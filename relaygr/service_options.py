"""What every service's config shares (gRPC limits, drain, metrics, logs, transport security)
and the servers those settings describe: the gRPC server and, when configured, `/metrics`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from relaygr.config import helped, require_positive
from relaygr.errors import ConfigError
from relaygr.grpc_server import GrpcServer, ServerOptions, start_server
from relaygr.logs import check_log_options
from relaygr.metrics import MetricsServer, check_metrics_port, start_metrics_server
from relaygr.security import SecurityOptions
from relaygr.telemetry import Telemetry
from relaygr.tls import log_transport, server_credentials

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServiceOptions(SecurityOptions):
    """The serving fields of every service config; `check_service` validates them."""

    max_message_mb: int = field(default=16, metadata=helped("largest gRPC message, MiB"))
    max_concurrent_streams: int = field(
        default=1024, metadata=helped("concurrent RPCs on one client connection (HTTP/2 streams)")
    )
    max_concurrent_rpcs: int = field(
        default=4096, metadata=helped("RPCs in progress at once; more get RESOURCE_EXHAUSTED")
    )
    drain_grace_s: float = field(default=10.0, metadata=helped("time to finish work on SIGTERM"))
    metrics_port: int = field(
        default=0,
        metadata=helped("serve Prometheus /metrics on this port, all interfaces (0: off)"),
    )
    log_level: str = field(
        default="INFO", metadata=helped("DEBUG, INFO, WARNING, ERROR or CRITICAL")
    )
    log_format: str = field(
        default="json", metadata=helped("json (one object per line, with trace ids) or text")
    )

    def check_service(self, service: str) -> None:
        """Raise ConfigError naming `service` and the field; call last from `__post_init__`
        (a service's own fields are named first, transport security last)."""
        check_metrics_port(self.metrics_port, service)
        check_log_options(self.log_level, self.log_format, service)
        require_positive(
            self,
            ("max_message_mb", "max_concurrent_streams", "max_concurrent_rpcs", "drain_grace_s"),
            service,
        )
        self.check_security(service)

    def server_options(self) -> ServerOptions:
        return ServerOptions(
            max_receive_message_bytes=self.max_message_mb * MIB,
            max_send_message_bytes=self.max_message_mb * MIB,
            max_concurrent_streams=self.max_concurrent_streams,
            max_concurrent_rpcs=self.max_concurrent_rpcs,
        )


async def start_service_servers(
    cfg: ServiceOptions,
    service: str,
    listen: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    telemetry: Telemetry,
    log: logging.Logger,
) -> tuple[GrpcServer, MetricsServer | None]:
    """The service's gRPC server on `listen` (health NOT_SERVING until the caller says) and its
    `/metrics` server where `telemetry` names one; neither is left running if one fails."""
    log_transport(cfg, service, log)
    server = await start_server(
        listen,
        register,
        service_names,
        cfg.server_options(),
        server_credentials(cfg),
        interceptors=telemetry.server_interceptors(),
    )
    if telemetry.metrics_address is None:
        return server, None
    try:
        return server, await start_metrics_server(telemetry.registry, telemetry.metrics_address)
    except ConfigError:
        await server.stop(0)
        raise
