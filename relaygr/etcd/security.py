"""How a client reaches a secured etcd (TLS files, user and password): settings, no transport."""

from dataclasses import dataclass, field
from pathlib import Path

from relaygr.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """How a client reaches a secured etcd: TLS (when `ca` or `cert` is set) and/or a user.

    `ca` verifies etcd's certificate (system roots when unset); `cert` and `key` are the client
    certificate etcd's `--client-cert-auth` asks for; `user` and `password` authenticate to
    etcd's auth (the password never appears in a repr or a log line).
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str = ""
    password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("etcd_cert and etcd_key must be set together")
        if self.user and not self.password:
            raise ConfigError(
                f"etcd_user {self.user!r} is set but etcd_password is empty: set the password"
                " (in deployments through the environment, RELAYGR_<SERVICE>_ETCD_PASSWORD)"
            )
        if self.password and not self.user:
            raise ConfigError("etcd_password is set but etcd_user is empty")

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    def describe(self) -> str:
        """How the client reaches etcd, for logs (never the password)."""
        parts = ["TLS" if self.tls else "plaintext"]
        if self.cert is not None:
            parts.append("client certificate")
        if self.user:
            parts.append(f"user {self.user!r}")
        return ", ".join(parts)
