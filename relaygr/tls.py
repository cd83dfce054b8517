"""TLS on every gRPC hop: server and channel credentials from a service's `tls_*` settings.

A service either speaks TLS on its server and on every outgoing hop, or (only when `plaintext`
is set) neither. With `tls_ca` set, the server requires a client certificate signed by that CA
(mutual TLS) and outgoing hops verify servers against it; each hop presents `tls_cert` as its
client certificate. A server re-reads its files when they change (each new connection gets the
current ones: renewed certificates without a restart); a channel reads them when it opens, and
`relaygr.cert_files` tells its owner when to open a new one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from relaygr.cert_files import CertificateFiles, check_key_matches, tls_paths
from relaygr.errors import ConfigError
from relaygr.tls_settings import TlsSettings

_log = logging.getLogger(__name__)

ChannelOption = tuple[str, Any]


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


def _server_config(settings: TlsSettings) -> Any:
    """The server's certificate configuration read from its files now (ConfigError if not)."""
    cert = read_pem(settings.tls_cert, "tls_cert")
    key = read_pem(settings.tls_key, "tls_key")
    if cert is None or key is None:
        raise ConfigError("a TLS server needs tls_cert and tls_key")
    check_key_matches(cert, key)
    ca = read_pem(settings.tls_ca, "tls_ca")
    client_ca = read_pem(getattr(settings, "tls_client_ca", None), "tls_client_ca")
    roots = ca + b"\n" + client_ca if ca is not None and client_ca is not None else ca
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=roots)


def server_credentials(settings: TlsSettings) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (None: plaintext); mutual TLS when `tls_ca` is set.

    The files are watched: a new connection after they change is served with what they hold
    then (a renewed certificate, a trust bundle without a revoked CA). A change that cannot be
    read, or a key that does not match its certificate (files caught mid-update), keeps the
    last good configuration and is retried on the next connection.
    """
    if settings.plaintext:
        return None
    files = CertificateFiles(tls_paths(settings))
    initial = _server_config(settings)
    files.changed()  # the fingerprint of what `initial` was read from

    def fetch() -> Any:
        if not files.changed():
            return None
        try:
            config = _server_config(settings)
        except ConfigError as err:
            _log.warning("renewed TLS files not taken yet (%s); serving the previous ones", err)
            files.forget()  # look again on the next connection
            return None
        _log.info("TLS files changed: new connections get the renewed certificates")
        return config

    return grpc.dynamic_ssl_server_credentials(
        initial, fetch, require_client_authentication=settings.tls_ca is not None
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
    """One start-up line on the transport, a WARNING when it is plaintext; with mutual TLS a
    second line on where refused callers are reported."""
    if settings.plaintext:
        log.warning(
            "%s serves and calls gRPC in PLAINTEXT (plaintext is set): traffic is unencrypted"
            " and callers are not authenticated; use TLS outside a local demo",
            service,
        )
        return
    log.info("%s serves and calls gRPC over %s", service, describe(settings))
    if settings.tls_ca is not None:
        # gRPC Python has no hook for failed handshakes: this says where they are reported.
        log.info(
            "%s: a caller refused by mutual TLS (no certificate, another CA, expired) never"
            " reaches a method and its client sees only UNAVAILABLE 'Socket closed'; gRPC"
            " logs each refusal, with its reason but not the caller's address, to stderr as"
            " 'Handshake failed with error ...' unless GRPC_VERBOSITY hides INFO"
            " (docs/security.md)",
            service,
        )
