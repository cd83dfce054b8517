"""Certificate files that may be renewed in place: whether they changed since last looked at,
and whether a key matches its certificate (so a half-finished renewal is never taken)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from relaygr.errors import ConfigError
from relaygr.tls_settings import TlsSettings

# Per file: (inode, size, modification time in ns); None where it cannot be read.
Fingerprint = tuple[tuple[int, int, int] | None, ...]


def tls_paths(settings: TlsSettings) -> tuple[Path, ...]:
    """The files a service's TLS is read from: certificate, key, CA bundles."""
    named = (settings.tls_cert, settings.tls_key, settings.tls_ca)
    return tuple(p for p in (*named, getattr(settings, "tls_client_ca", None)) if p is not None)


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class CertificateFiles:
    """Tells when `paths` changed (replaced, rewritten) since the last look.

    `changed` looks at most once per `min_interval_s` on `clock` (0: every time): cheap enough
    for a hot path that asks on every call. A Kubernetes Secret volume or cert-manager's
    csi-driver swaps all files at once; a writer that does not may be seen mid-update, which
    is why the server checks the key against its certificate before taking them.
    """

    def __init__(
        self,
        paths: Sequence[Path],
        min_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._paths = tuple(paths)
        self._interval = min_interval_s
        self._clock = clock
        self._seen: Fingerprint | None = None
        self._looked = -float("inf")

    def fingerprint(self) -> Fingerprint:
        return tuple(_stat(p) for p in self._paths)

    def changed(self) -> bool:
        """Whether the files differ from the last look (True on the first look)."""
        if self._interval > 0:
            now = self._clock()
            if now - self._looked < self._interval:
                return False
            self._looked = now
        current = self.fingerprint()
        if current == self._seen:
            return False
        self._seen = current
        return True

    def forget(self) -> None:
        """Make the next look report a change (a renewal seen but not taken yet)."""
        self._seen = None


def check_key_matches(cert_pem: bytes, key_pem: bytes) -> None:
    """ConfigError unless the private key in `key_pem` belongs to the first certificate in
    `cert_pem` (a renewal caught between writing the two files)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as err:
        raise ConfigError(f"cannot parse the certificate or its key: {err}") from err
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*raw) != key.public_key().public_bytes(*raw):
        raise ConfigError("tls_key does not match tls_cert (a renewal half written?)")
