"""A throwaway certificate authority for local meshes and tests: CA, node and client certificates.

Never for production: the CA key sits next to the certificates in a temporary directory. In a
cluster, certificates come from the platform (cert-manager, a mesh CA) and reach the services as
file paths (`--tls-cert`, `--tls-key`, `--tls-ca`; docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from relaygr.authz import DEFAULT_TRUST_DOMAIN, Identity, Role
from relaygr.tls_settings import ClientTls

LOOPBACK_NAMES = ("localhost", "127.0.0.1")
_VALID_FOR = datetime.timedelta(days=7)
_CLOCK_SKEW = datetime.timedelta(hours=1)
_CA_KEY_USAGE = dict.fromkeys(
    ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
     "encipher_only", "decipher_only"),
    False,
) | {"digital_signature": True, "key_cert_sign": True, "crl_sign": True}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Leaf:
    """A certificate and its key, naming one identity."""

    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class Pki:
    """Files written by `make_pki`: one CA (and its key), a node certificate, a client
    certificate, and one certificate per identity on demand (`identity`).

    Identity certificates carry the URI `spiffe://<trust_domain>/relaygr/<role>/<instance>`
    that authorization reads, the common name `relaygr-<role>` that etcd's client-certificate
    authentication takes as its user, and both server and client usage, so one process can
    serve TLS and present the same certificate on its outgoing hops (to other services and to
    etcd). The node certificate names no identity (etcd's own). The client certificate is the
    `client` identity, for callers that only call (tests, benchmarks, a demo driver). The
    expired client certificate, same CA, lapsed a day ago: what mutual TLS refuses.
    """

    directory: Path
    ca_cert: Path
    ca_key: Path
    node_cert: Path
    node_key: Path
    client_cert: Path
    client_key: Path
    expired_client_cert: Path
    expired_client_key: Path
    hosts: tuple[str, ...] = LOOPBACK_NAMES
    trust_domain: str = DEFAULT_TRUST_DOMAIN

    def identity(self, role: Role, instance: str, *, renew: bool = False) -> Leaf:
        """The certificate of `role`/`instance`, issued on first use (or again when `renew`:
        a new key and certificate, each file replaced at once, for rotation)."""
        leaf = Leaf(
            self.directory / f"{role.value}-{instance}.pem",
            self.directory / f"{role.value}-{instance}-key.pem",
        )
        if renew or not leaf.cert.exists():
            self.issue_into(leaf, role, instance)
        return leaf

    def issue_into(self, leaf: Leaf, role: Role, instance: str) -> Leaf:
        """Sign a new key and certificate for `role`/`instance` with this CA into `leaf`'s
        files (another CA's files too: a rotation to this CA), each replaced at once."""
        ca = _Authority.load(self.ca_cert, self.ca_key)
        uri = Identity(self.trust_domain, role, instance).uri
        cert, key = ca.issue(f"relaygr-{role.value}", self.hosts, server=True, uris=(uri,))
        # Key first: a reader that sees the new certificate finds its key already there (one
        # that sees the new key with the old certificate finds them mismatched and waits).
        _replace(leaf.key, _key_pem(key), private=True)
        _replace(leaf.cert, cert.public_bytes(serialization.Encoding.PEM))
        return leaf

    def service_flags(self, role: Role, instance: str) -> tuple[str, ...]:
        """Command-line flags that make a service of `role` serve and call over mutual TLS
        (and reach etcd) with its own identity."""
        leaf = self.identity(role, instance)
        return (
            "--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key),
            "--tls-ca", str(self.ca_cert), "--trust-domain", self.trust_domain,
            "--etcd-ca", str(self.ca_cert), "--etcd-cert", str(leaf.cert),
            "--etcd-key", str(leaf.key),
        )  # fmt: skip

    def tls(self, role: Role, instance: str) -> ClientTls:
        """The TLS settings of a process holding `role`/`instance`'s identity."""
        leaf = self.identity(role, instance)
        return ClientTls(tls_ca=self.ca_cert, tls_cert=leaf.cert, tls_key=leaf.key)

    def client(self) -> ClientTls:
        """What a caller outside the mesh needs to dial a service over mutual TLS."""
        return ClientTls(tls_ca=self.ca_cert, tls_cert=self.client_cert, tls_key=self.client_key)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "RelayGR throwaway"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _subject_alt_names(
    hosts: tuple[str, ...], uris: tuple[str, ...] = ()
) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri) for uri in uris]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def _replace(path: Path, data: bytes, private: bool = False) -> Path:
    """Write `data` beside `path`, then rename it over: a reader sees the old or the new."""
    partial = _write(path.with_name(path.name + ".partial"), data, private)
    partial.replace(path)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class _Authority:
    """Signs leaf certificates with one freshly generated CA key (ECDSA P-256)."""

    def __init__(
        self,
        common_name: str,
        now: datetime.datetime,
        loaded: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
    ) -> None:
        self._now = now
        if loaded is not None:
            self.cert, self.key = loaded
            self.name = self.cert.subject
            return
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(common_name)
        self.cert = (
            self._builder(self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(**_CA_KEY_USAGE), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )

    @classmethod
    def load(cls, cert: Path, key: Path) -> _Authority:
        """The authority whose certificate and key `make_pki` wrote."""
        ca_key = serialization.load_pem_private_key(key.read_bytes(), password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        ca_cert = x509.load_pem_x509_certificate(cert.read_bytes())
        return cls("", datetime.datetime.now(datetime.UTC), (ca_cert, ca_key))

    def _builder(
        self,
        subject: x509.Name,
        public_key: ec.EllipticCurvePublicKey,
        issued: datetime.datetime | None = None,
    ) -> x509.CertificateBuilder:
        """Valid for `_VALID_FOR` from `issued` (default: the authority's now), less the skew."""
        issued = issued or self._now
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(issued - _CLOCK_SKEW)
            .not_valid_after(issued + _VALID_FOR)
        )

    def issue(
        self,
        common_name: str,
        hosts: tuple[str, ...],
        *,
        server: bool,
        issued: datetime.datetime | None = None,
        uris: tuple[str, ...] = (),
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        builder = (
            self._builder(_name(common_name), key.public_key(), issued)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if hosts or uris:
            builder = builder.add_extension(_subject_alt_names(hosts, uris), critical=False)
        return builder.sign(self.key, hashes.SHA256()), key


def make_pki(
    directory: Path,
    *,
    hosts: tuple[str, ...] = LOOPBACK_NAMES,
    ca_name: str = "relaygr-throwaway-ca",
    now: datetime.datetime | None = None,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
) -> Pki:
    """Generate a CA and certificates for `hosts` (DNS names or IP addresses) into `directory`.

    Keys are written readable by the owner only. The certificates are valid for a week from
    `now` (default: the current time), with an hour of allowance for clock skew, except the
    expired client certificate, whose week ended a day before `now`. The client certificate is
    the identity `spiffe://<trust_domain>/relaygr/client/client`.
    """
    directory.mkdir(parents=True, exist_ok=True)
    now = now or datetime.datetime.now(datetime.UTC)
    ca = _Authority(ca_name, now)
    node, node_key = ca.issue("relaygr-node", hosts, server=True)
    client_uri = Identity(trust_domain, Role.CLIENT, "client").uri
    client, client_key = ca.issue("relaygr-client", (), server=False, uris=(client_uri,))
    lapsed = now - _VALID_FOR - datetime.timedelta(days=1)
    expired, expired_key = ca.issue("relaygr-expired-client", (), server=False, issued=lapsed)
    pem = serialization.Encoding.PEM
    return Pki(
        directory=directory,
        ca_cert=_write(directory / "ca.pem", ca.cert.public_bytes(pem)),
        ca_key=_write(directory / "ca-key.pem", _key_pem(ca.key), private=True),
        node_cert=_write(directory / "node.pem", node.public_bytes(pem)),
        node_key=_write(directory / "node-key.pem", _key_pem(node_key), private=True),
        client_cert=_write(directory / "client.pem", client.public_bytes(pem)),
        client_key=_write(directory / "client-key.pem", _key_pem(client_key), private=True),
        expired_client_cert=_write(directory / "expired-client.pem", expired.public_bytes(pem)),
        expired_client_key=_write(
            directory / "expired-client-key.pem", _key_pem(expired_key), private=True
        ),
        hosts=hosts,
        trust_domain=trust_domain,
    )
