"""The authorization table as a full matrix (every role against every method), identities,
the refusal log's throttle, etcd's grants, and the table printed in docs/security.md."""

import re
from pathlib import Path

import pytest

from relaygr.authz import (
    MESH,
    AuthzStats,
    Identity,
    Role,
    Throttle,
    mesh_policy,
    parse_identity,
    parse_roles,
    refusal,
    render_table,
    table_methods,
)
from relaygr.errors import ConfigError
from relaygr.etcd.roles import ETCD_GRANTS, etcd_user, etcdctl_commands
from relaygr.v1 import ranker_pb2, router_pb2, trigger_pb2
from services.router.config import RouterConfig
from services.trigger.config import TriggerConfig
from tooling import cli

ROOT = Path(__file__).resolve().parents[2]
RANKER = "/relaygr.v1.RankerService/"
ROUTER = "/relaygr.v1.RouterService/"
TRIGGER = "/relaygr.v1.TriggerService/"
R, RT, T, C = Role.RANKER, Role.ROUTER, Role.TRIGGER, Role.CLIENT
ANY = frozenset(Role)

# What the service graph needs, written out apart from the table under test.
EXPECTED = {
    RANKER + "Handoff": {R},
    RANKER + "Fetch": {R},
    RANKER + "PreInfer": {R, RT, T},
    RANKER + "Rank": {R, RT, T},
    RANKER + "Describe": ANY,
    ROUTER + "PreInfer": {C, T},
    ROUTER + "Rank": {C, T},
    TRIGGER + "OnRetrieval": {C, T},
    "/grpc.health.v1.Health/Check": ANY,
    "/grpc.health.v1.Health/Watch": ANY,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": ANY,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": ANY,
}


def _contract_methods() -> set[str]:
    methods = set()
    for module in (ranker_pb2, router_pb2, trigger_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            methods |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return methods


def test_every_method_of_the_contract_is_in_the_matrix() -> None:
    assert _contract_methods() <= set(EXPECTED)


@pytest.mark.parametrize("method", sorted(EXPECTED))
@pytest.mark.parametrize("role", [*Role, None], ids=lambda r: str(r))
def test_matrix_each_role_against_each_method(method: str, role: Role | None) -> None:
    policy = mesh_policy()
    allowed = role is not None and role in EXPECTED[method]
    if EXPECTED[method] == ANY:
        allowed = True  # open: mutual TLS already authenticated the caller
    assert policy.permits(method, role) == allowed, (method, role)


def test_entry_callers_are_configurable_and_only_touch_the_entry_methods() -> None:
    policy = mesh_policy(frozenset({Role.CLIENT}))
    for method in (ROUTER + "Rank", ROUTER + "PreInfer", TRIGGER + "OnRetrieval"):
        assert policy.allowed(method) == {Role.CLIENT}
    assert policy.allowed(RANKER + "Rank") == MESH
    assert not policy.permits(RANKER + "Nope", Role.RANKER)  # unknown: nobody


def test_identity_uris_round_trip_and_anything_else_is_no_identity() -> None:
    identity = Identity("example.org", Role.RANKER, "ranker-3")
    assert identity.uri == "spiffe://example.org/relaygr/ranker/ranker-3"
    assert parse_identity(identity.uri) == identity
    for uri in (
        "spiffe://example.org/relaygr/admin/x",  # unknown role
        "spiffe://example.org/relaygr/ranker/",  # no instance
        "spiffe://example.org/other/ranker/x",
        "spiffe:///relaygr/ranker/x",
        "spiffe://example.org/relaygr/ranker/x/y",
        "https://example.org/relaygr/ranker/x",
        "",
    ):
        assert parse_identity(uri) is None, uri


def test_roles_are_parsed_with_a_message_naming_the_valid_ones() -> None:
    assert parse_roles(["client", " trigger"], "x") == {Role.CLIENT, Role.TRIGGER}
    with pytest.raises(ConfigError, match="router authz_entry_callers: unknown role 'admin'"):
        parse_roles(["admin"], "router authz_entry_callers")


def test_service_configs_refuse_unknown_entry_callers_and_a_client_ca_in_plaintext() -> None:
    with pytest.raises(ConfigError, match="router authz_entry_callers: unknown role 'admin'"):
        RouterConfig(plaintext=True, authz_entry_callers=("client", "admin"))
    with pytest.raises(ConfigError, match="plaintext is set together with tls_client_ca"):
        TriggerConfig(plaintext=True, tls_client_ca=Path("ca.pem"))
    assert RouterConfig(plaintext=True).entry_callers() == {Role.CLIENT, Role.TRIGGER}


def test_refusal_names_method_and_role_and_stats_count_by_both() -> None:
    assert "Fetch is not allowed for a caller with role 'client'" in refusal(
        RANKER + "Fetch", Role.CLIENT
    )
    assert "role 'no relaygr identity'" in refusal(RANKER + "Fetch", None)
    stats = AuthzStats()
    stats.count(RANKER + "Fetch", Role.CLIENT)
    stats.count(RANKER + "Fetch", Role.CLIENT)
    stats.count(RANKER + "Handoff", None)
    assert stats.refused == {(RANKER + "Fetch", "client"): 2, (RANKER + "Handoff", "none"): 1}


def test_throttle_reports_once_per_interval_per_key_with_the_count_held_back() -> None:
    throttle = Throttle(10.0)
    assert throttle.admit("a", 0.0) == 0
    assert throttle.admit("a", 1.0) is None
    assert throttle.admit("a", 9.9) is None
    assert throttle.admit("b", 5.0) == 0  # keys are apart
    assert throttle.admit("a", 10.0) == 2
    assert throttle.admit("a", 10.5) is None


def test_the_table_in_docs_is_the_table_in_code() -> None:
    policy = mesh_policy()
    table = render_table(policy, table_methods(policy))
    docs = (ROOT / "docs" / "security.md").read_text()
    block = re.search(r"<!-- authz-table -->\n```\n(.*?)```", docs, re.S)
    assert block is not None, "docs/security.md lacks the authz-table block"
    assert block.group(1).rstrip("\n") == table


@pytest.mark.parametrize("service", ["ranker", "router", "trigger"])
def test_every_service_prints_the_table_in_its_help(
    service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.main([service, "--help"])
    out = capsys.readouterr().out
    policy = mesh_policy()
    assert render_table(policy, table_methods(policy)) in out


def test_etcd_grants_let_rankers_and_routers_write_only_their_keys() -> None:
    def writes(role: Role) -> set[str]:
        return {g.under for g in ETCD_GRANTS[role] if g.permission.value == "readwrite"}

    assert writes(Role.RANKER) == {"rankers/", "directory/"}
    assert writes(Role.ROUTER) == {"directory/"}
    assert writes(Role.TRIGGER) == set() and ETCD_GRANTS[Role.CLIENT] == ()
    commands = etcdctl_commands("/relaygr/")
    assert ("role", "grant-permission", "relaygr-router", "readwrite", "/relaygr/directory/",
            "--prefix=true") in commands  # fmt: skip
    assert ("user", "add", "relaygr-ranker", "--no-password") in commands
    assert not any(etcd_user(Role.CLIENT) in c for c in commands)
