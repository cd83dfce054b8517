"""TLS on every gRPC hop: server and channel credentials from a service's `tls_*` settings.

A service either speaks TLS on its server and on every outgoing hop, or (only when `plaintext`
is set) neither. With `tls_ca` set, the server requires a client certificate signed by that CA
(mutual TLS) and outgoing hops verify servers against it; each hop presents `tls_cert` as its
client certificate. Certificate files are read when a server starts or a channel opens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from relaygr.errors import ConfigError

ChannelOption = tuple[str, Any]


class TlsSettings(Protocol):
    """The transport fields of every service config (and of `ClientTls`)."""

    @property
    def tls_cert(self) -> Path | None: ...
    @property
    def tls_key(self) -> Path | None: ...
    @property
    def tls_ca(self) -> Path | None: ...
    @property
    def tls_server_name(self) -> str: ...
    @property
    def plaintext(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class ClientTls:
    """The transport of a caller that is not a service (a driver, a test, a benchmark).

    A client needs no certificate of its own unless the server requires one (mutual TLS);
    `tls_ca` None verifies servers against the system's roots.
    """

    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_server_name: str = ""
    plaintext: bool = False

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("a client certificate needs both tls_cert and tls_key")


PLAINTEXT = ClientTls(plaintext=True)

_MATERIAL = ("tls_cert", "tls_key", "tls_ca", "tls_server_name")


def check_tls(settings: TlsSettings, service: str) -> None:
    """Raise ConfigError unless `settings` choose exactly one of plaintext and TLS.

    TLS needs a certificate and its key; `tls_ca` is optional (it turns on mutual TLS).
    """
    given = [name for name in _MATERIAL if getattr(settings, name)]
    if settings.plaintext:
        if given:
            raise ConfigError(
                f"{service}: plaintext is set together with {', '.join(given)}:"
                " choose plaintext or TLS, not both"
            )
        return
    if settings.tls_cert is None and settings.tls_key is None:
        raise ConfigError(
            f"{service}: no transport security configured. Set tls_cert and tls_key to serve"
            " TLS (and tls_ca to require client certificates signed by that CA: mutual TLS),"
            " or set plaintext (--plaintext) to serve unencrypted gRPC, for local demos only"
        )
    if settings.tls_cert is None or settings.tls_key is None:
        missing = "tls_key" if settings.tls_key is None else "tls_cert"
        raise ConfigError(f"{service}: tls_cert and tls_key must be set together; {missing} is not")


def read_pem(path: Path | None, what: str) -> bytes | None:
    """The bytes of a PEM file (None for None); ConfigError naming `what` if unreadable."""
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror or err}") from err
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what} {path} is not a PEM file")
    return data


def server_credentials(settings: TlsSettings) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (None: plaintext); mutual TLS when `tls_ca` is set."""
    if settings.plaintext:
        return None
    cert = read_pem(settings.tls_cert, "tls_cert")
    key = read_pem(settings.tls_key, "tls_key")
    if cert is None or key is None:
        raise ConfigError("a TLS server needs tls_cert and tls_key")
    ca = read_pem(settings.tls_ca, "tls_ca")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(settings: TlsSettings) -> grpc.ChannelCredentials | None:
    """TLS credentials for an outgoing channel (None: plaintext).

    The server is verified against `tls_ca` (system roots when unset); `tls_cert` and `tls_key`,
    when set, are presented as the client certificate.
    """
    if settings.plaintext:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(settings.tls_ca, "tls_ca"),
        private_key=read_pem(settings.tls_key, "tls_key"),
        certificate_chain=read_pem(settings.tls_cert, "tls_cert"),
    )


def _secure_options(settings: TlsSettings, options: Sequence[ChannelOption]) -> list[ChannelOption]:
    """`options` plus the server-name override, when `tls_server_name` is set."""
    if not settings.tls_server_name:
        return list(options)
    return [*options, ("grpc.ssl_target_name_override", settings.tls_server_name)]


def open_channel(
    address: str,
    settings: TlsSettings,
    options: Sequence[ChannelOption] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """An asyncio channel to `address`, TLS or plaintext as `settings` say; `interceptors`
    (tracing) wrap every call on it."""
    credentials = channel_credentials(settings)
    if credentials is None:
        return grpc.aio.insecure_channel(
            address, options=list(options), interceptors=list(interceptors) or None
        )
    return grpc.aio.secure_channel(
        address,
        credentials,
        options=_secure_options(settings, options),
        interceptors=list(interceptors) or None,
    )


def open_blocking_channel(
    address: str, settings: TlsSettings, options: Sequence[ChannelOption] = ()
) -> grpc.Channel:
    """A synchronous channel to `address`, TLS or plaintext as `settings` say."""
    credentials = channel_credentials(settings)
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=_secure_options(settings, options))


def describe(settings: TlsSettings) -> str:
    """How a service speaks gRPC, for its start-up log."""
    if settings.plaintext:
        return "PLAINTEXT"
    if settings.tls_ca is not None:
        return f"mutual TLS (client certificates signed by {settings.tls_ca} required)"
    return "TLS (client certificates not checked: set tls_ca for mutual TLS)"


def log_transport(settings: TlsSettings, service: str, log: logging.Logger) -> None:
    """One start-up line on the transport; a WARNING when it is plaintext."""
    if settings.plaintext:
        log.warning(
            "%s serves and calls gRPC in PLAINTEXT (plaintext is set): traffic is unencrypted"
            " and callers are not authenticated; use TLS outside a local demo",
            service,
        )
    else:
        log.info("%s serves and calls gRPC over %s", service, describe(settings))
