"""What every service's config shares: where it listens, the mesh's etcd, gRPC limits, drain,
metrics, logs and transport security. Settings and their validation only: `relaygr.lifecycle`
starts what they describe."""

from __future__ import annotations

from dataclasses import dataclass, field

from relaygr.bounds import POSITIVE, Bound, non_negative
from relaygr.config import helped
from relaygr.errors import ConfigError
from relaygr.log_options import check_log_options
from relaygr.security import SecurityOptions

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Transport limits for one gRPC server; every value must be positive."""

    max_receive_message_bytes: int = 16 * 1024 * 1024
    max_send_message_bytes: int = 16 * 1024 * 1024
    max_concurrent_streams: int = 1024
    # RPCs in progress on the whole server; past it gRPC answers RESOURCE_EXHAUSTED at once.
    max_concurrent_rpcs: int | None = None
    # A client connection's life: past it the server sends GOAWAY and the client connects (and
    # resolves its target) again; calls in flight get `max_connection_age_grace_s`. None: forever.
    max_connection_age_s: float | None = None
    max_connection_age_grace_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_receive_message_bytes", "max_send_message_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be a positive number of bytes")
        if self.max_concurrent_streams <= 0:
            raise ConfigError("max_concurrent_streams must be a positive integer")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs <= 0:
            raise ConfigError("max_concurrent_rpcs must be a positive integer")
        if self.max_connection_age_s is not None and self.max_connection_age_s <= 0:
            raise ConfigError("max_connection_age_s must be a positive number of seconds")
        if self.max_connection_age_grace_s <= 0:
            raise ConfigError("max_connection_age_grace_s must be a positive number of seconds")

    def message_args(self) -> list[tuple[str, int]]:
        """The message size limits, for a client channel of this service as well as its server."""
        return [
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            ("grpc.max_send_message_length", self.max_send_message_bytes),
        ]

    def server_args(self) -> list[tuple[str, int]]:
        """The server's gRPC arguments."""
        args = [
            *self.message_args(),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            # Without this a second server on the same explicit port would silently share it.
            ("grpc.so_reuseport", 0),
        ]
        if self.max_connection_age_s is not None:
            args += [
                ("grpc.max_connection_age_ms", round(self.max_connection_age_s * 1e3)),
                ("grpc.max_connection_age_grace_ms", round(self.max_connection_age_grace_s * 1e3)),
            ]
        return args


def listen_field(default: str) -> str:
    """The `listen` field of a service config, with that service's default address."""
    return field(default=default, metadata=helped("gRPC listen address"))


def health_linger_field(default: float) -> float:
    """The `health_linger_s` field of a service config, with that service's default."""
    return field(
        default=default,
        metadata=helped(
            "on SIGTERM, seconds to serve on after health turns NOT_SERVING, before the drain:"
            " callers that watch health (client-side health checking) move to another replica",
            non_negative("0: none"),
        ),
    )


@dataclass(frozen=True, slots=True)
class ServiceOptions(SecurityOptions):
    """The fields every service config extends; `check_service` validates them.

    A service redeclares `listen` (with `listen_field`) for its own default port, and may
    redeclare `etcd_endpoints` (the ranker: none, standalone).
    """

    listen: str = listen_field("127.0.0.1:0")
    etcd_endpoints: tuple[str, ...] = field(
        default=("127.0.0.1:2379",), metadata=helped("etcd endpoints, host:port[,...]")
    )
    etcd_prefix: str = field(default="/relaygr", metadata=helped("etcd key prefix of the mesh"))
    max_message_mb: int = field(default=16, metadata=helped("largest gRPC message, MiB", POSITIVE))
    max_concurrent_streams: int = field(
        default=1024,
        metadata=helped("concurrent RPCs on one client connection (HTTP/2 streams)", POSITIVE),
    )
    max_concurrent_rpcs: int = field(
        default=4096,
        metadata=helped("RPCs in progress at once; more get RESOURCE_EXHAUSTED", POSITIVE),
    )
    drain_grace_s: float = field(
        default=10.0, metadata=helped("time to finish work on SIGTERM, seconds", POSITIVE)
    )
    health_linger_s: float = health_linger_field(0.5)
    max_connection_age_s: float = field(
        default=0.0,
        metadata=helped(
            "close each client connection after this many seconds (GOAWAY; its calls get"
            " drain_grace_s), so a caller that resolves every replica (a headless Service)"
            " reconnects and resolves again, and spreads over replicas added since",
            non_negative("0: never"),
        ),
    )
    metrics_port: int = field(
        default=0,
        metadata=helped(
            "serve Prometheus /metrics on this port", Bound(low=0, high=65535, meaning="0: none")
        ),
    )
    # All interfaces by default: in a cluster Prometheus scrapes the pod's address.
    metrics_host: str = field(
        default="0.0.0.0",
        metadata=helped("address /metrics listens on (127.0.0.1: this machine only)"),
    )
    log_level: str = field(
        default="INFO", metadata=helped("DEBUG, INFO, WARNING, ERROR or CRITICAL")
    )
    log_format: str = field(
        default="json", metadata=helped("json (one object per line, with trace ids) or text")
    )

    def check_service(self, service: str, *, etcd_required: bool = True) -> None:
        """Raise ConfigError naming `service` and the field; call last from `__post_init__`,
        after `check_bounds(self, service)` and the service's own rules (transport security is
        checked last). `etcd_required` False lets a service run standalone, with no etcd
        endpoints."""
        if etcd_required and not self.etcd_endpoints:
            raise ConfigError(f"{service} etcd_endpoints must name at least one host:port")
        check_log_options(self.log_level, self.log_format, service)
        self.check_security(service)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where `/metrics` is served (host, port); None: nowhere."""
        return None if self.metrics_port == 0 else (self.metrics_host, self.metrics_port)

    def server_options(self) -> ServerOptions:
        return ServerOptions(
            max_receive_message_bytes=self.max_message_mb * MIB,
            max_send_message_bytes=self.max_message_mb * MIB,
            max_concurrent_streams=self.max_concurrent_streams,
            max_concurrent_rpcs=self.max_concurrent_rpcs,
            max_connection_age_s=self.max_connection_age_s or None,
            max_connection_age_grace_s=self.drain_grace_s,
        )
