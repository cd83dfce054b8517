"""Mutual TLS at every service and to etcd, etcd authentication, and the relay over TLS."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relaygr.errors import Unavailable
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.errors import EtcdAuthFailed, EtcdRejected
from relaygr.etcd.security import EtcdSecurity
from relaygr.grpc_server import start_server
from relaygr.tls import open_blocking_channel, open_channel, server_credentials
from relaygr.tls_settings import PLAINTEXT, ClientTls, TlsSettings
from relaygr.v1 import common_pb2, ranker_pb2, ranker_pb2_grpc, router_pb2_grpc, trigger_pb2_grpc
from relaygr.wire import rank_request_to_proto
from services.router.forward import RouterStats
from tests.integration.etcd_server import started_etcd
from tests.integration.mesh_harness import running_mesh
from tests.integration.process_mesh import mesh_workdirs, tiny_mesh
from tests.integration.ranker_harness import reply_scores, tiny_model
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input, rel_err
from tooling.local.certs import Pki, make_pki
from tooling.local.drive import retrieval_event
from tooling.local.etcd_server import EtcdServer, EtcdTls
from tooling.local.mesh import LocalMesh

HIT = common_pb2.CACHE_OUTCOME_HBM_HIT
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def stranger(tmp_path: Path) -> Pki:
    """Certificates from another CA: valid, but not signed by the mesh's."""
    return make_pki(tmp_path / "stranger", ca_name="another-ca")


@pytest.fixture
def tls_etcd(pki: Pki) -> Iterator[EtcdServer]:
    """An etcd serving TLS that requires client certificates signed by `pki`'s CA."""
    with started_etcd(tls=EtcdTls(pki.ca_cert, pki.node_cert, pki.node_key)) as server:
        yield server


def _untrusted_callers(pki: Pki, stranger: Pki) -> dict[str, ClientTls]:
    return {
        "plaintext": PLAINTEXT,
        "no client certificate": ClientTls(tls_ca=pki.ca_cert),
        "certificate of another CA": ClientTls(
            tls_ca=pki.ca_cert, tls_cert=stranger.client_cert, tls_key=stranger.client_key
        ),
    }


async def _health(address: str, tls: TlsSettings) -> object:
    """The health status `address` reports to a caller with `tls`, or the refusal's code."""
    async with open_channel(address, tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
        return reply.status


async def test_with_mutual_tls_each_service_refuses_untrusted_callers_and_the_relay_runs(
    etcd_server: EtcdServer, pki: Pki, stranger: Pki, rng: np.random.Generator
) -> None:
    """Trigger, router and ranker serve mutual TLS (and call each other over it): a caller
    without a certificate signed by the CA is refused at each, before any method runs; the
    relay runs end to end, its Rank an HBM hit scoring exactly like full inference."""
    model = tiny_model()

    async with running_mesh(etcd_server.endpoint, model, pki=pki) as mesh:
        for name in ("r0", "r1"):
            await mesh.add_ranker(name)
        router = await mesh.add_router()
        trigger = await mesh.add_trigger(mode="all")
        addresses = {
            "trigger": f"127.0.0.1:{mesh.triggers[0].port}",
            "router": f"127.0.0.1:{mesh.routers[0].port}",
            **{name: f"127.0.0.1:{r.port}" for name, r in mesh.rankers.items()},
        }
        for service, address in addresses.items():
            assert await _health(address, mesh.client) == SERVING, service
            for caller, tls in _untrusted_callers(pki, stranger).items():
                code = await _health(address, tls)
                assert code == grpc.StatusCode.UNAVAILABLE, (service, caller, code)

        request = rank_input(rng, prefix(rng, 300, user_id="alice"), 16, 8)
        async with open_channel(addresses["router"], PLAINTEXT) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await router_pb2_grpc.RouterServiceStub(channel).Rank(
                    rank_request_to_proto(request), timeout=10
                )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert mesh.routers[0].servicer.stats == RouterStats()  # nothing reached the router

        decision = await trigger.OnRetrieval(retrieval_event(request, "r1"))
        assert decision.admitted, decision
        servicer = mesh.triggers[0].servicer
        await eventually(lambda: servicer.stats.relayed == 1, "relayed over TLS")
        reply = await router.Rank(rank_request_to_proto(request))
        assert reply.instance_id == decision.target_instance
        assert reply.cache_outcome == HIT
        scores = reply_scores(reply)
        assert rel_err(scores, model.full_forward(request).numpy()) <= 1e-5


async def test_a_caller_refused_by_mutual_tls_sees_socket_closed_and_stderr_says_why(
    pki: Pki, stranger: Pki, capfd: pytest.CaptureFixture[str]
) -> None:
    """What docs/security.md says of a refused caller: whatever the cause, its client gets
    UNAVAILABLE "Socket closed" (the server closes the connection without a TLS alert), and
    the cause is only in the one line per refused handshake that gRPC core writes to the
    server's stderr, without the caller's address (no hook lets Python see the handshake)."""
    node = ClientTls(tls_ca=pki.ca_cert, tls_cert=pki.node_cert, tls_key=pki.node_key)
    server = await start_server(
        "127.0.0.1:0", lambda _: None, [], credentials=server_credentials(node)
    )
    address = f"127.0.0.1:{server.port}"
    causes = {  # caller: the reason gRPC core logs for it
        "no client certificate": "PEER_DID_NOT_RETURN_A_CERTIFICATE",
        "certificate of another CA": "CERTIFICATE_VERIFY_FAILED: unable to get local issuer",
        "expired certificate": "CERTIFICATE_VERIFY_FAILED: certificate has expired",
        "plaintext": "WRONG_VERSION_NUMBER",
    }
    callers = _untrusted_callers(pki, stranger) | {
        "expired certificate": ClientTls(
            tls_ca=pki.ca_cert, tls_cert=pki.expired_client_cert, tls_key=pki.expired_client_key
        )
    }
    stderr: list[str] = []
    try:
        await server.set_serving(True)
        assert await _health(address, pki.client()) == SERVING
        capfd.readouterr()
        for caller, cause in causes.items():
            async with open_channel(address, callers[caller]) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=10
                    )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, caller
            assert refused.value.details() == (
                f"failed to connect to all addresses; last error: UNAVAILABLE: ipv4:{address}:"
                " Socket closed"
            ), caller

            def logged(cause: str = cause) -> bool:
                stderr.append(capfd.readouterr().err)
                return any(
                    "Handshake failed with error" in line and cause in line
                    for line in "".join(stderr).splitlines()
                )

            await eventually(logged, f"the server's stderr names {cause} ({caller})")
    finally:
        await server.stop(0)


async def test_etcd_with_client_certificate_auth_refuses_clients_without_a_trusted_one(
    tls_etcd: EtcdServer, pki: Pki, stranger: Pki
) -> None:
    trusted = EtcdClient([tls_etcd.endpoint], security=tls_etcd.client_security())
    seen: list[str] = []
    try:
        watch = await trusted.watch_prefix("/relaygr/", lambda event: seen.append(event.key))
        lease = await trusted.grant_lease(5)
        await trusted.put("/relaygr/k", b"v", lease)
        assert await trusted.get("/relaygr/k") == b"v"
        await eventually(lambda: seen == ["/relaygr/k"], "the watch saw the put")
        await watch.cancel()
    finally:
        await trusted.close()
    untrusted = {
        "plaintext": None,
        "no client certificate": EtcdSecurity(ca=pki.ca_cert),
        "certificate of another CA": EtcdSecurity(
            ca=pki.ca_cert, cert=stranger.client_cert, key=stranger.client_key
        ),
    }
    for caller, security in untrusted.items():
        client = EtcdClient([tls_etcd.endpoint], security=security, request_timeout_s=2.0)
        try:
            with pytest.raises(Unavailable) as err:
                await client.get("/relaygr/k")
        finally:
            await client.close()
        assert tls_etcd.endpoint in str(err.value), caller


async def test_etcd_with_auth_refuses_unauthenticated_and_wrong_password_clients(
    etcd_server: EtcdServer,
) -> None:
    """With etcd's authentication on, a client without a user or with a wrong password is
    refused with a message naming the settings to fix; a user limited to the mesh's prefix
    serves a whole mesh (leases, watches, directory writes) and nothing outside it."""
    etcd_server.enable_auth("root-pw")
    etcd_server.add_user("relaygr", "right-pw", "/relaygr")
    endpoint = etcd_server.endpoint

    refused = {
        "user name is empty": None,
        "authentication failed": EtcdSecurity(user="relaygr", password="wrong-pw"),
    }
    for message, security in refused.items():
        client = EtcdClient([endpoint], security=security)
        try:
            with pytest.raises(EtcdAuthFailed) as err:
                await client.put("/relaygr/k", b"v")
        finally:
            await client.close()
        assert message in str(err.value) and "etcd_password" in str(err.value)
        assert "wrong-pw" not in str(err.value)
    app = EtcdClient([endpoint], security=EtcdSecurity(user="relaygr", password="right-pw"))
    try:
        await app.put("/relaygr/k", b"v")
        assert await app.get("/relaygr/k") == b"v"
        with pytest.raises(EtcdRejected, match="permission denied"):
            await app.put("/elsewhere", b"v")
    finally:
        await app.close()

    credentials = {"etcd_user": "relaygr", "etcd_password": "right-pw"}
    async with running_mesh(endpoint, tiny_model()) as mesh:
        await mesh.add_ranker("r0", **credentials)
        await mesh.add_router(**credentials)  # converged: its watch sees r0's lease
        with pytest.raises(EtcdAuthFailed, match="authentication failed"):
            await mesh.add_router(etcd_user="relaygr", etcd_password="wrong-pw")


async def test_an_expired_etcd_auth_token_is_renewed_by_reconnecting() -> None:
    """etcd's simple auth tokens lapse after --auth-token-ttl without use (300 s by default): a
    router idle that long must authenticate again by itself, not fail its next write."""
    with started_etcd(extra_args=("--auth-token-ttl=1",)) as server:
        server.enable_auth("root-pw")

        client = EtcdClient([server.endpoint], security=server.client_security("root", "root-pw"))
        try:
            await client.put("/relaygr/k", b"1")
            # The lapse of time is what is under test: idle past the token's TTL.
            await asyncio.sleep(2.5)
            assert await client.get("/relaygr/k") == b"1"
        finally:
            await client.close()


def test_relaygr_up_tls_runs_the_relay_over_mutual_tls_and_removes_its_ca(
    rng: np.random.Generator, private_tempdir: Path
) -> None:
    """`relaygr up --tls`: a throwaway CA, etcd and every service process on mutual TLS, each
    with its own identity; the relay runs end to end through the router and the trigger with
    the client certificate, which a ranker's Fetch and Handoff and etcd refuse; plaintext
    callers are refused; the CA's files go with the mesh."""
    before = mesh_workdirs()
    spec, model = tiny_mesh(trigger_args=("--mode", "all"), tls=True)
    with LocalMesh(spec) as mesh:
        assert mesh.trigger is not None and mesh.router is not None and mesh.pki is not None
        ca_dir = mesh.pki.directory
        request = rank_input(rng, prefix(rng, 300, user_id="alice"), 16, 8)
        with open_blocking_channel(mesh.trigger.address, mesh.client_tls) as channel:
            decision = trigger_pb2_grpc.TriggerServiceStub(channel).OnRetrieval(
                retrieval_event(request, "r1"), timeout=30
            )
        assert decision.admitted, decision
        with open_blocking_channel(mesh.router.address, mesh.client_tls) as channel:
            router = router_pb2_grpc.RouterServiceStub(channel)

            def hit() -> bool:
                reply = router.Rank(rank_request_to_proto(request), timeout=30)
                replies.append(reply)
                return reply.cache_outcome == HIT

            # The relay lands in the background: a Rank before it lands is a miss that caches
            # the same prefix, so a later one is a hit either way; scores must match throughout.
            replies: list[common_pb2.RankReply] = []
            asyncio.run(eventually(hit, "a Rank served from the relayed prefix", timeout_s=30))
        expected = model.full_forward(request).numpy()
        for reply in replies:
            assert rel_err(reply_scores(reply), expected) <= 1e-5
        # The client certificate reaches rankers only through the router and the trigger.
        for ranker in mesh.rankers:
            with open_blocking_channel(ranker.address, mesh.client_tls) as channel:
                stub = ranker_pb2_grpc.RankerServiceStub(channel)
                calls = {
                    "Fetch": lambda s=stub: list(s.Fetch(ranker_pb2.FetchRequest(), timeout=10)),
                    "Handoff": lambda s=stub: s.Handoff(iter(()), timeout=10),
                }
                for method, call in calls.items():
                    with pytest.raises(grpc.RpcError) as denied:
                        call()
                    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
                    assert f"RankerService/{method} is not allowed for a caller with role" \
                        " 'client'" in denied.value.details()  # type: ignore[attr-defined]  # fmt: skip
        for service in (mesh.trigger, mesh.router, *mesh.rankers):
            with open_blocking_channel(service.address, PLAINTEXT) as channel:
                with pytest.raises(grpc.RpcError) as err:
                    health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=10
                    )
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, service.name  # type: ignore[attr-defined]

        async def etcd_refuses_plaintext() -> None:
            client = EtcdClient([mesh.etcd_endpoint], request_timeout_s=2.0)
            try:
                with pytest.raises(Unavailable):
                    await client.get("/relaygr/rankers/")
            finally:
                await client.close()

        asyncio.run(etcd_refuses_plaintext())

        async def etcd_refuses_client_writes() -> None:
            client = EtcdClient(
                [mesh.etcd_endpoint],
                security=EtcdSecurity(
                    ca=mesh.pki.ca_cert, cert=mesh.pki.client_cert, key=mesh.pki.client_key
                ),
                request_timeout_s=5.0,
            )
            try:
                for key in ("/relaygr/rankers/forged", "/relaygr/directory/v/alice"):
                    with pytest.raises(EtcdRejected):
                        await client.put(key, b"{}")
            finally:
                await client.close()

        asyncio.run(etcd_refuses_client_writes())
    assert not ca_dir.exists()
    assert mesh_workdirs() == before
