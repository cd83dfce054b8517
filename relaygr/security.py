"""The security fields every service config inherits: gRPC TLS and etcd TLS/authentication."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relaygr.config import helped
from relaygr.errors import ConfigError
from relaygr.etcd.security import EtcdSecurity
from relaygr.tls_settings import check_tls


@dataclass(frozen=True, slots=True)
class SecurityOptions:
    """Transport security of one service (docs/security.md).

    Invariant, checked by `check_security` from each service's `__post_init__`: the service
    either serves and calls gRPC over TLS (`tls_cert` and `tls_key` set) or `plaintext` is set
    explicitly, never both and never neither. `etcd_password` is left out of the repr.
    """

    tls_cert: Path | None = field(
        default=None, metadata=helped("PEM certificate served, and presented on outgoing hops")
    )
    tls_key: Path | None = field(default=None, metadata=helped("PEM private key of tls_cert"))
    tls_ca: Path | None = field(
        default=None,
        metadata=helped(
            "PEM CA bundle: verifies the servers this service calls and, when set, requires"
            " callers to present a certificate signed by it (mutual TLS)"
        ),
    )
    tls_server_name: str = field(
        default="",
        metadata=helped("name checked in servers' certificates on outgoing hops (default: host)"),
    )
    plaintext: bool = field(
        default=False,
        metadata=helped("serve and call gRPC unencrypted and unauthenticated (local demos only)"),
    )
    etcd_ca: Path | None = field(
        default=None, metadata=helped("PEM CA that signed etcd's certificate (turns on TLS)")
    )
    etcd_cert: Path | None = field(
        default=None, metadata=helped("PEM client certificate for etcd --client-cert-auth")
    )
    etcd_key: Path | None = field(default=None, metadata=helped("PEM private key of etcd_cert"))
    etcd_user: str = field(default="", metadata=helped("etcd user (etcd auth enabled)"))
    etcd_password: str = field(
        default="",
        repr=False,
        metadata=helped("password of etcd_user; pass it through the environment, not a flag"),
    )

    def check_security(self, service: str) -> None:
        """Raise ConfigError naming `service` when the transport choice is missing or mixed."""
        check_tls(self, service)
        try:
            self.etcd_security()
        except ConfigError as err:
            raise ConfigError(f"{service}: {err}") from err

    def etcd_security(self) -> EtcdSecurity:
        """How this service reaches etcd (ConfigError when the etcd_* fields are inconsistent)."""
        return EtcdSecurity(
            ca=self.etcd_ca,
            cert=self.etcd_cert,
            key=self.etcd_key,
            user=self.etcd_user,
            password=self.etcd_password,
        )
