"""Who may call what on real servers over mutual TLS (loopback): every identity against every
method of the ranker, router and trigger; etcd's roles; certificates rotated under load with no
failed request, then the old CA revoked."""

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relaygr.authz import Role, mesh_policy
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.errors import EtcdRejected
from relaygr.etcd.security import EtcdSecurity
from relaygr.tls import open_channel
from relaygr.tls_settings import ClientTls
from relaygr.v1 import router_pb2_grpc
from relaygr.wire import rank_request_to_proto
from tests.integration.etcd_server import started_etcd
from tests.integration.mesh_harness import Mesh, running_mesh
from tests.integration.ranker_harness import reply_scores, tiny_model
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input, rel_err
from tooling.local.certs import Leaf, Pki, make_pki
from tooling.local.etcd_server import EtcdServer, EtcdTls

DENIED = grpc.StatusCode.PERMISSION_DENIED
SERVING = health_pb2.HealthCheckResponse.SERVING
RANKER = "/relaygr.v1.RankerService/"
ROUTER = "/relaygr.v1.RouterService/"
TRIGGER = "/relaygr.v1.TriggerService/"
HEALTH = "/grpc.health.v1.Health/Check"
# server kind -> the methods it serves (called with an empty message; an allowed call reaches
# the handler and fails there, or not, but never with PERMISSION_DENIED)
SERVED = {
    "ranker": [RANKER + m for m in ("PreInfer", "Rank", "Describe", "Handoff", "Fetch")] + [HEALTH],
    "router": [ROUTER + "PreInfer", ROUTER + "Rank", HEALTH],
    "trigger": [TRIGGER + "OnRetrieval", HEALTH],
}


async def _code(channel: grpc.aio.Channel, method: str) -> tuple[grpc.StatusCode, str]:
    """The status of `method` called with an empty message (an empty stream for Handoff)."""
    try:
        if method.endswith("/Handoff"):
            await channel.stream_unary(method)(iter(()), timeout=10)
        elif method.endswith("/Fetch"):
            async for _ in channel.unary_stream(method)(b"", timeout=10):
                pass
        else:
            await channel.unary_unary(method)(b"", timeout=10)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _callers(pki: Pki, tmp: Path) -> dict[str, tuple[Role | None, ClientTls]]:
    """Each identity a caller may hold: one per role, one signed by the CA without any URI,
    and one naming a ranker of another trust domain (both: no role)."""
    callers: dict[str, tuple[Role | None, ClientTls]] = {
        role.value: (role, pki.tls(role, f"{role.value}-x")) for role in Role
    }
    callers["no identity"] = (
        None,
        ClientTls(tls_ca=pki.ca_cert, tls_cert=pki.node_cert, tls_key=pki.node_key),
    )
    leaf = Leaf(tmp / "foreign-ranker.pem", tmp / "foreign-ranker-key.pem")
    replace(pki, trust_domain="elsewhere.org").issue_into(leaf, Role.RANKER, "r9")  # our CA
    callers["ranker of another trust domain"] = (
        None,
        ClientTls(tls_ca=pki.ca_cert, tls_cert=leaf.cert, tls_key=leaf.key),
    )
    return callers


async def test_every_identity_against_every_method_on_real_servers(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """The full matrix on a ranker, a router and a trigger serving mutual TLS: each caller is
    refused exactly the methods the table refuses its role, with PERMISSION_DENIED naming the
    method and the role, counted per method and role; every other call reaches its handler."""
    pki = make_pki(tmp_path / "pki")
    policy = mesh_policy()
    async with running_mesh(etcd_server.endpoint, tiny_model(), pki, serve_metrics=True) as mesh:
        ranker = await mesh.add_ranker("r0")
        await mesh.add_router()
        await mesh.add_trigger(mode="all")
        ports = {
            "ranker": ranker.port,
            "router": mesh.routers[0].port,
            "trigger": mesh.triggers[0].port,
        }
        expected_refusals: dict[tuple[str, str], int] = {}
        for caller, (role, tls) in _callers(pki, tmp_path).items():
            for kind, port in ports.items():
                async with open_channel(f"127.0.0.1:{port}", tls) as channel:
                    for method in SERVED[kind]:
                        code, details = await _code(channel, method)
                        if policy.permits(method, role):
                            assert code != DENIED, (caller, method, details)
                        else:
                            assert code == DENIED, (caller, method, code, details)
                            who = role.value if role is not None else "no relaygr identity"
                            assert f"{method} is not allowed" in details, details
                            assert f"role '{who}'" in details, details
                            key = (method, role.value if role is not None else "none")
                            expected_refusals[key] = expected_refusals.get(key, 0) + 1
        assert ("/relaygr.v1.RankerService/Fetch", "client") in expected_refusals
        # The one hand-off taken (from the ranker identity, naming no sender in its metadata)
        # is recorded as from the instance its certificate names.
        receiving = ranker.servicer.handoff
        assert receiving is not None
        assert dict(receiving.stats.received_from) == {"ranker-x": 1}
        counted: dict[tuple[str, str], float] = {}
        for telemetry in mesh.telemetry:
            for metric in telemetry.registry.collect():
                if metric.name == "relaygr_authz_refused":
                    for sample in metric.samples:
                        if sample.name.endswith("_total"):
                            key = (sample.labels["method"], sample.labels["role"])
                            counted[key] = counted.get(key, 0) + sample.value
        assert counted == expected_refusals


@pytest.fixture
def role_etcd(tmp_path: Path) -> AsyncIterator[tuple[EtcdServer, Pki]]:
    """An etcd with client-certificate auth, authentication on and the mesh's roles granted."""
    pki = make_pki(tmp_path / "pki")
    with started_etcd(tls=EtcdTls(pki.ca_cert, pki.node_cert, pki.node_key)) as server:
        server.enable_auth("root-pw")
        server.grant_mesh_roles()
        yield server, pki


def _etcd_as(server: EtcdServer, pki: Pki, role: Role) -> EtcdClient:
    leaf = pki.identity(role, f"{role.value}-0")
    security = EtcdSecurity(ca=pki.ca_cert, cert=leaf.cert, key=leaf.key)
    return EtcdClient([server.endpoint], security=security, request_timeout_s=5.0)


async def test_etcd_lets_each_role_write_only_its_keys(
    role_etcd: tuple[EtcdServer, Pki],
) -> None:
    """A client identity is refused every write (and read); a router may write the directory
    but not a membership key; a ranker both; a trigger only reads."""
    server, pki = role_etcd
    writes = {
        Role.RANKER: {"/relaygr/rankers/r0": True, "/relaygr/directory/v/u": True,
                      "/relaygr/config/trigger": False},
        Role.ROUTER: {"/relaygr/rankers/r0": False, "/relaygr/directory/v/u": True,
                      "/relaygr/config/trigger": False},
        Role.TRIGGER: {"/relaygr/rankers/r0": False, "/relaygr/directory/v/u": False},
        Role.CLIENT: {"/relaygr/rankers/r0": False, "/relaygr/directory/v/u": False},
    }  # fmt: skip
    for role, keys in writes.items():
        client = _etcd_as(server, pki, role)
        try:
            for key, allowed in keys.items():
                if allowed:
                    await client.put(key, b"v")
                    assert await client.get(key) == b"v"
                else:
                    with pytest.raises(EtcdRejected, match=r"permission denied|user name"):
                        await client.put(key, b"forged")
            if role is Role.CLIENT:
                with pytest.raises(EtcdRejected):
                    await client.get("/relaygr/rankers/r0")
            else:
                assert await client.get("/relaygr/rankers/r0") == b"v"
        finally:
            await client.close()


def _publish_bundle(path: Path, *cas: Path) -> None:
    """Replace the CA bundle at `path` at once with `cas` concatenated."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(b"".join(ca.read_bytes() for ca in cas))
    os.replace(partial, path)


async def _traffic(
    mesh: Mesh, stub: router_pb2_grpc.RouterServiceStub, rng: np.random.Generator,
    stop: asyncio.Event, served: list[int], failures: list[str],
) -> None:  # fmt: skip
    """Ranks through the router until `stop`, each checked exact."""
    requests = [rank_input(rng, prefix(rng, 48, user_id=f"u{i}"), 4, 4) for i in range(8)]
    i = 0
    while not stop.is_set():
        request = requests[i % len(requests)]
        i += 1
        try:
            reply = await stub.Rank(rank_request_to_proto(request), timeout=10)
            expected = mesh.model.full_forward(request).numpy()
            assert rel_err(reply_scores(reply), expected) <= 1e-5
            served[0] += 1
        except (grpc.aio.AioRpcError, AssertionError) as err:
            failures.append(repr(err))


async def _health_code(address: str, tls: ClientTls) -> object:
    async with open_channel(address, tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
        return reply.status


async def test_certificates_rotate_under_load_and_the_old_ca_is_revoked_after(
    etcd_server: EtcdServer, tmp_path: Path, rng: np.random.Generator
) -> None:
    """Every leaf is re-issued by a new CA (trusted beside the old one), under Rank traffic
    through the router to two rankers over mutual TLS; then the old CA leaves the trust
    bundle. No request fails; servers serve the new certificates to new connections and the
    router's channels follow the renewed files without a restart; a certificate of the old
    CA is refused afterwards."""
    pki = make_pki(tmp_path / "pki")
    new_ca = make_pki(tmp_path / "new-ca")
    original_ca = tmp_path / "old-ca.pem"
    original_ca.write_bytes(pki.ca_cert.read_bytes())
    # The client certificate the old CA signed, kept: what the revocation must shut out.
    old_cert, old_key = tmp_path / "old-client.pem", tmp_path / "old-client-key.pem"
    old_cert.write_bytes(pki.client_cert.read_bytes())
    old_key.write_bytes(pki.client_key.read_bytes())
    revoked = ClientTls(tls_ca=new_ca.ca_cert, tls_cert=old_cert, tls_key=old_key)
    # Verifies servers by the new CA only: only a server serving a renewed certificate passes.
    renewed = ClientTls(tls_ca=new_ca.ca_cert, tls_cert=pki.client_cert, tls_key=pki.client_key)
    async with running_mesh(etcd_server.endpoint, tiny_model(), pki) as mesh:
        for name in ("r0", "r1"):
            await mesh.add_ranker(name)
        stub = await mesh.add_router()
        router = mesh.routers[0]
        addresses = [f"127.0.0.1:{r.port}" for r in mesh.rankers.values()]
        addresses.append(f"127.0.0.1:{router.port}")
        stop, served, failures = asyncio.Event(), [0], []
        loops = [
            asyncio.create_task(_traffic(mesh, stub, rng, stop, served, failures)) for _ in range(4)
        ]
        try:
            await eventually(lambda: served[0] >= 20, "traffic flows before the rotation")
            # 1. Trust both CAs everywhere, then re-issue every leaf from the new one.
            _publish_bundle(pki.ca_cert, original_ca, new_ca.ca_cert)
            for name in ("r0", "r1"):
                new_ca.issue_into(pki.identity(Role.RANKER, name), Role.RANKER, name)
            new_ca.issue_into(pki.identity(Role.ROUTER, "router-0"), Role.ROUTER, "router-0")
            new_ca.issue_into(Leaf(pki.client_cert, pki.client_key), Role.CLIENT, "client")
            at_rotation = served[0]
            await eventually(lambda: router.pool.renewals >= 1, "the router's channels renewed")
            for address in addresses:
                assert await _health_code(address, renewed) == SERVING, address
            await eventually(lambda: served[0] >= at_rotation + 40, "traffic after rotation")
            # 2. Revoke the old CA: the bundle names the new one only.
            _publish_bundle(pki.ca_cert, new_ca.ca_cert)
            at_revocation = served[0]
            await eventually(lambda: served[0] >= at_revocation + 40, "traffic after revocation")
        finally:
            stop.set()
            await asyncio.gather(*loops)
        assert not failures, failures[:3]
        print(f"ranks served: {served[0]} (rotation at {at_rotation}, revoked at {at_revocation})")
        # The old CA's certificate (still within its validity) is refused at every server;
        # the renewed one is served.
        for address in addresses:
            assert await _health_code(address, revoked) == grpc.StatusCode.UNAVAILABLE, address
            assert await _health_code(address, renewed) == SERVING, address
