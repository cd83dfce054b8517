"""The transport-security settings of a service or a caller, and the rule they must follow.

A service either speaks TLS on its server and on every outgoing hop, or (only when `plaintext`
is set) neither; `relaygr.tls` turns these settings into gRPC credentials and channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from relaygr.errors import ConfigError


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
