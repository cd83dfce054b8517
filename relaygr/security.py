"""The security fields every service config inherits: gRPC TLS and etcd TLS/authentication."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relaygr.authz import DEFAULT_ENTRY_CALLERS, DEFAULT_TRUST_DOMAIN, Role, parse_roles
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
    tls_client_ca: Path | None = field(
        default=None,
        metadata=helped(
            "PEM CA bundle that also verifies callers (e.g. the CA of clients outside the mesh);"
            " the server trusts tls_ca and this"
        ),
    )
    authz: bool = field(
        default=True,
        metadata=helped(
            "with mutual TLS, allow each method only to the caller roles named in"
            " docs/security.md (spiffe://<trust_domain>/relaygr/<role>/<instance> certificates)"
        ),
    )
    trust_domain: str = field(
        default=DEFAULT_TRUST_DOMAIN,
        metadata=helped("SPIFFE trust domain of the callers' identities"),
    )
    authz_entry_callers: tuple[str, ...] = field(
        default=tuple(sorted(DEFAULT_ENTRY_CALLERS)),
        metadata=helped(
            "roles that may call the router's PreInfer and Rank and the trigger's OnRetrieval"
        ),
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
        self.entry_callers(service)
        if self.plaintext and self.tls_client_ca is not None:
            raise ConfigError(f"{service}: plaintext is set together with tls_client_ca")
        try:
            self.etcd_security()
        except ConfigError as err:
            raise ConfigError(f"{service}: {err}") from err

    def entry_callers(self, service: str = "") -> frozenset[Role]:
        """The roles of `authz_entry_callers` (ConfigError naming `service` for an unknown one)."""
        return parse_roles(self.authz_entry_callers, f"{service} authz_entry_callers".strip())

    def etcd_security(self) -> EtcdSecurity:
        """How this service reaches etcd (ConfigError when the etcd_* fields are inconsistent)."""
        return EtcdSecurity(
            ca=self.etcd_ca,
            cert=self.etcd_cert,
            key=self.etcd_key,
            user=self.etcd_user,
            password=self.etcd_password,
        )
