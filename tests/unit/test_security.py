"""Transport-security config rules, the throwaway CA, and the pre-allocation input limits."""

import argparse
import datetime
import logging
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from relaygr.config import add_config_arguments, load_config
from relaygr.errors import ConfigError, InvalidInput
from relaygr.etcd.security import EtcdSecurity
from relaygr.tls import log_transport
from relaygr.tls_settings import ClientTls
from relaygr.v1 import common_pb2, router_pb2
from relaygr.wire import InputLimits, check_lengths
from services.ranker.config import RankerConfig
from services.router.config import RouterConfig
from services.router.limits import RequestLimits, check_limits, packed_count
from services.trigger.config import ENV_PREFIX as TRIGGER_ENV
from services.trigger.config import TriggerConfig
from tooling.local.certs import make_pki

CONFIGS = (RankerConfig, RouterConfig, TriggerConfig)


@pytest.mark.parametrize("cls", CONFIGS)
def test_a_service_with_neither_tls_nor_plaintext_is_refused(cls: type) -> None:
    with pytest.raises(ConfigError) as err:
        cls()
    message = str(err.value)
    assert "no transport security configured" in message
    assert "tls_cert and tls_key" in message and "plaintext" in message


@pytest.mark.parametrize("cls", CONFIGS)
def test_plaintext_and_tls_are_exclusive_and_a_certificate_needs_its_key(cls: type) -> None:
    with pytest.raises(ConfigError, match="plaintext is set together with tls_cert"):
        cls(plaintext=True, tls_cert=Path("c.pem"), tls_key=Path("k.pem"))
    with pytest.raises(ConfigError, match="tls_key is not"):
        cls(tls_cert=Path("c.pem"))
    with pytest.raises(ConfigError, match="tls_cert is not"):
        cls(tls_key=Path("k.pem"), tls_ca=Path("ca.pem"))
    assert cls(plaintext=True).plaintext
    assert cls(tls_cert=Path("c.pem"), tls_key=Path("k.pem")).tls_ca is None


def test_etcd_credentials_must_be_complete_and_the_password_never_shows() -> None:
    with pytest.raises(ConfigError, match="router: etcd_user 'relay' is set but etcd_password"):
        RouterConfig(plaintext=True, etcd_user="relay")
    with pytest.raises(ConfigError, match="etcd_password is set but etcd_user is empty"):
        RouterConfig(plaintext=True, etcd_password="s3cret")
    with pytest.raises(ConfigError, match="etcd_cert and etcd_key must be set together"):
        RouterConfig(plaintext=True, etcd_cert=Path("c.pem"))
    # In deployments the password comes from the environment; it is in no repr or description.
    env = {f"{TRIGGER_ENV}PLAINTEXT": "true", f"{TRIGGER_ENV}ETCD_USER": "relay",
           f"{TRIGGER_ENV}ETCD_PASSWORD": "s3cret-pw"}  # fmt: skip
    cfg = load_config(TriggerConfig, env=env, env_prefix=TRIGGER_ENV)
    security = cfg.etcd_security()
    assert (cfg.etcd_password, security.password, security.user) == (
        "s3cret-pw",
        "s3cret-pw",
        "relay",
    )
    for text in (repr(cfg), str(cfg), repr(security), security.describe()):
        assert "s3cret-pw" not in text
    assert "etcd_user='relay'" in repr(cfg)


def test_every_service_takes_the_security_flags() -> None:
    for cls in CONFIGS:
        parser = argparse.ArgumentParser()
        add_config_arguments(parser, cls, env_prefix="X_")
        flags = {word.strip(",") for word in parser.format_help().split()}
        for flag in (
            "--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name", "--plaintext",
            "--etcd-ca", "--etcd-cert", "--etcd-key", "--etcd-user", "--etcd-password",
            "--max-concurrent-streams", "--max-concurrent-rpcs", "--max-message-mb",
        ):  # fmt: skip
            assert flag in flags, (cls.__name__, flag)


def test_plaintext_logs_one_warning_and_tls_says_which(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("relaygr.test")
    with caplog.at_level(logging.INFO, logger="relaygr.test"):
        log_transport(ClientTls(plaintext=True), "router", log)
        log_transport(ClientTls(tls_ca=Path("ca.pem")), "ranker", log)
        log_transport(ClientTls(tls_cert=Path("c.pem"), tls_key=Path("k.pem")), "trigger", log)
    (warning, info, refusals, tls) = caplog.records
    assert warning.levelno == logging.WARNING and "router" in warning.message
    assert "PLAINTEXT" in warning.message and "unencrypted" in warning.message
    assert info.levelno == logging.INFO and "mutual TLS" in info.message
    # Where refused callers are reported, since no RelayGR code sees a failed handshake.
    assert refusals.levelno == logging.INFO and refusals.message.startswith("ranker: ")
    assert "'Handshake failed with error ...'" in refusals.message
    assert tls.message == (
        "trigger serves and calls gRPC over TLS (client certificates not checked: set tls_ca"
        " for mutual TLS)"
    )


def test_the_throwaway_ca_signs_node_and_client_certificates(tmp_path: Path) -> None:
    now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    pki = make_pki(tmp_path / "pki", now=now)
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    node = x509.load_pem_x509_certificate(pki.node_cert.read_bytes())
    client = x509.load_pem_x509_certificate(pki.client_cert.read_bytes())
    expired = x509.load_pem_x509_certificate(pki.expired_client_cert.read_bytes())
    for leaf in (node, client, expired):
        leaf.verify_directly_issued_by(ca)
    for leaf in (node, client):
        assert leaf.not_valid_before_utc < now < leaf.not_valid_after_utc
    assert expired.not_valid_after_utc == now - datetime.timedelta(days=1)
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    usage = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    for key in (pki.node_key, pki.client_key, pki.expired_client_key):
        assert key.stat().st_mode & 0o777 == 0o600
    assert pki.client() == ClientTls(
        tls_ca=pki.ca_cert, tls_cert=pki.client_cert, tls_key=pki.client_key
    )
    assert EtcdSecurity(ca=pki.ca_cert).tls and not EtcdSecurity().tls


def test_packed_count_counts_varints_of_every_width() -> None:
    values = [0, 1, 127, 128, 2**14, 2**40, 2**63 - 1, -1]  # -1 is ten bytes as int64
    packed = common_pb2.Behaviours(item_ids=values).SerializeToString()
    parsed = router_pb2.PackedItems.FromString(packed)
    assert len(parsed.item_ids) > len(values)
    assert packed_count(parsed.item_ids) == len(values)
    assert packed_count(b"") == 0


def _key(features: int, long_term: int, short_term: int, candidates: int) -> router_pb2.RoutingKey:
    def column(n: int) -> common_pb2.Behaviours:
        return common_pb2.Behaviours(
            item_ids=[2**40 + i for i in range(n)], actions=[1] * n, timestamps=[7] * n
        )

    request = common_pb2.RankRequest(
        user_id="u",
        user_features=list(range(features)),
        long_term=column(long_term),
        short_term=column(short_term),
        candidate_ids=[2**50 + i for i in range(candidates)],
    )
    return router_pb2.RoutingKey.FromString(request.SerializeToString())


def test_router_limits_are_exact_at_the_boundary() -> None:
    limits = RequestLimits(max_tokens=100, max_candidates=10)
    check_limits(_key(4, 90, 6, 10), limits)  # exactly at both limits
    with pytest.raises(InvalidInput, match=r"101 history tokens .* router's limit of 100"):
        check_limits(_key(4, 90, 7, 10), limits)
    with pytest.raises(InvalidInput, match="11 candidates exceed the router's limit of 10"):
        check_limits(_key(0, 1, 0, 11), limits)
    # PreInferRequest's fields 5 and 6 are scalars: they stay unknown, never miscounted.
    pre = common_pb2.PreInferRequest(
        user_id="u", long_term=common_pb2.Behaviours(item_ids=[1] * 100), relay_window_ms=500,
        request_ts=1_700_000_000,
    )  # fmt: skip
    key = router_pb2.RoutingKey.FromString(pre.SerializeToString())
    assert (key.user_id, key.short_term.item_ids, key.candidate_ids) == ("u", b"", b"")
    check_limits(key, limits)


def test_ranker_lengths_are_checked_on_the_message_before_arrays_are_built() -> None:
    limits = InputLimits(max_user_features=4, max_tokens=100, max_candidates=10)
    ok = common_pb2.RankRequest(
        user_id="u", user_features=[1] * 4, candidate_ids=[1] * 10,
        long_term=common_pb2.Behaviours(item_ids=[1] * 50, actions=[1] * 50, timestamps=[1] * 50),
        short_term=common_pb2.Behaviours(item_ids=[1] * 46, actions=[1] * 46, timestamps=[1] * 46),
    )  # fmt: skip
    check_lengths(ok, limits)
    cases = {
        "5 user features exceed the limit of 4": {"user_features": [1] * 5},
        "11 candidates exceed the limit of 10": {"candidate_ids": [1] * 11},
        # One overlong column is enough, ragged or not: nothing is copied out first.
        "prefix has 1000004 tokens": {"long_term.timestamps": [1] * 1_000_000},
        "request has 101 history tokens": {"short_term.actions": [1] * 47},
    }
    for message, change in cases.items():
        request = common_pb2.RankRequest()
        request.CopyFrom(ok)
        ((path, value),) = change.items()
        target: object = request
        *parents, name = path.split(".")
        for parent in parents:
            target = getattr(target, parent)
        getattr(target, name)[:] = value
        with pytest.raises(InvalidInput, match=message):
            check_lengths(request, limits)
