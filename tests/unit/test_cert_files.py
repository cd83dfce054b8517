"""Renewed certificate files: change detection (throttled), a key that does not match its
certificate, and the client side's renewal refusing half-written files."""

from pathlib import Path

import pytest

from relaygr.authz import Role
from relaygr.cert_files import CertificateFiles, check_key_matches
from relaygr.channel_renewal import ChannelRenewal
from relaygr.errors import ConfigError
from relaygr.tls_settings import ClientTls
from tooling.local.certs import Leaf, make_pki


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_changes_are_seen_once_and_looked_for_at_most_once_per_interval(tmp_path: Path) -> None:
    path = tmp_path / "a.pem"
    path.write_text("one")
    clock = Clock()
    files = CertificateFiles([path], min_interval_s=1.0, clock=clock)
    assert files.changed()  # the first look
    assert not files.changed()
    replacement = tmp_path / "a.pem.new"
    replacement.write_text("two, longer")
    replacement.replace(path)
    assert not files.changed()  # within the interval: not looked at
    clock.now = 1.0
    assert files.changed()
    clock.now = 2.0
    assert not files.changed()
    files.forget()
    clock.now = 3.0
    assert files.changed()


def test_a_key_of_another_certificate_is_refused(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    ranker = pki.identity(Role.RANKER, "r0")
    router = pki.identity(Role.ROUTER, "router")
    check_key_matches(ranker.cert.read_bytes(), ranker.key.read_bytes())
    with pytest.raises(ConfigError, match="tls_key does not match tls_cert"):
        check_key_matches(ranker.cert.read_bytes(), router.key.read_bytes())


async def test_channels_are_renewed_only_once_the_key_matches_its_certificate(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path / "pki")
    leaf = pki.identity(Role.ROUTER, "router")
    renewal = ChannelRenewal(
        ClientTls(tls_ca=pki.ca_cert, tls_cert=leaf.cert, tls_key=leaf.key), interval_s=0.0
    )
    assert not renewal.due()
    spare = pki.issue_into(Leaf(tmp_path / "new.pem", tmp_path / "new-key.pem"), Role.ROUTER, "r")
    spare.key.replace(leaf.key)  # the new key is in place, its certificate not yet
    assert not renewal.due()
    spare.cert.replace(leaf.cert)
    assert renewal.due() and renewal.renewals == 1
    assert not renewal.due()
    assert not ChannelRenewal(ClientTls(plaintext=True)).due()
