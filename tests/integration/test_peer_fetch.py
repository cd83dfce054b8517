"""Peer fetch on loopback (real etcd, real rankers, a router): after a scale-out, moved users
are served from prefixes fetched from their previous owner, with exact scores, when the
transfer is predicted cheaper, and recomputed when it is not; a peer that stalls, dies
mid-fetch, has nothing or sends a corrupted entry costs a recomputation, never a failed Rank
or a wrong score."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from relaygr.behaviours import RankInput
from relaygr.lifecycle import connect_mesh
from relaygr.placement import ranking
from relaygr.pool import RankerPool
from relaygr.tls_settings import PLAINTEXT
from relaygr.v1 import common_pb2, ranker_pb2, ranker_pb2_grpc
from relaygr.wire import rank_request_to_proto
from services.ranker.digest import PrefixHasher
from services.ranker.fetch import Fetched, Peer
from services.ranker.fetch_client import GrpcPeerSource
from services.ranker.kv_store import CacheKey, Tier
from services.ranker.model import RankingModel
from services.ranker.outcomes import FetchResult
from services.ranker.server import RankerServer, ranker_record
from services.ranker.transfer import chunks, encode
from services.ranker.transfer_wire import header_to_proto
from tests.integration.etcd_server import EtcdServer
from tests.integration.mesh_harness import Mesh, running_mesh
from tests.integration.ranker_harness import BASE, COST, poll, reply_scores, tiny_model
from tests.unit.ranker.factories import prefix, rank_input, rel_err
from tooling.local.certs import make_pki

Outcome = common_pb2.CacheOutcome
# A transfer far cheaper than the tiny model's prefill under the harness's cost (~2 ms), and
# one far dearer; the harness gives rankers their cost model, so neither is refitted. Priced at
# 0.01 ms, a fetch would get only the default 20 ms floor past its prediction, and on a loaded
# host these loopback fetches took 2-28 ms (a moved user then timed out into a MISS): the
# floor gives them the cap's 2 s, as a slow network's operator would.
CHEAP = {
    "transfer_fixed_ms": 0.01,
    "transfer_ms_per_mb": 0.01,
    "fetch_timeout_ms": 2000,
    "fetch_timeout_floor_ms": 2000,
}
DEAR = {"transfer_fixed_ms": 1e6, "transfer_ms_per_mb": 0.0}
OLD, NEW = ("r0", "r1", "r2"), "r3"


def users(moved: int, stay: int) -> list[str]:
    """User ids of which `moved` are owned by the joining ranker once it joins, `stay` not."""
    found: dict[bool, list[str]] = {True: [], False: []}
    i = 0
    while len(found[True]) < moved or len(found[False]) < stay:
        user = f"user{i}"
        i += 1
        goes = ranking(user, [*OLD, NEW])[0] == NEW
        if len(found[goes]) < (moved if goes else stay):
            found[goes].append(user)
    return found[True] + found[False]


def assert_exact(model: RankingModel, reply: common_pb2.RankReply, request: RankInput) -> None:
    err = rel_err(reply_scores(reply), model.full_forward(request).numpy())
    assert err <= 1e-5, (reply.instance_id, err)


async def scale_out(
    mesh: Mesh, rng: np.random.Generator, **config: object
) -> list[tuple[str, str, str, int]]:
    """Three warm rankers, a router, then a fourth ranker; every user ranked after it joined:
    (user, its ranker before, its ranker after, the outcome there)."""
    for name in OLD:
        await mesh.add_ranker(name, **config)
    router = await mesh.add_router()
    ids = users(moved=6, stay=6)
    print("users", ids)
    warm: dict[str, str] = {}
    prefixes = {user: prefix(rng, 100, user_id=user) for user in ids}
    for user in ids:
        request = rank_input(rng, prefixes[user])
        reply = await router.Rank(rank_request_to_proto(request), timeout=10)
        assert reply.cache_outcome == Outcome.CACHE_OUTCOME_MISS
        warm[user] = reply.instance_id
    joined = await mesh.add_ranker(NEW, **config)  # waits until the router's view has it
    assert joined.mesh is not None
    await poll(lambda: set(joined.mesh.cluster.view()) == {*OLD, NEW})  # type: ignore[union-attr]
    results = []
    for user in ids:
        request = rank_input(rng, prefixes[user])
        reply = await router.Rank(rank_request_to_proto(request), timeout=10)
        assert_exact(mesh.model, reply, request)
        results.append((user, warm[user], reply.instance_id, reply.cache_outcome))
    return results


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mutual-tls"])
async def test_moved_users_are_served_from_fetched_prefixes_when_fetching_is_cheaper(
    etcd_server: EtcdServer, rng: np.random.Generator, tls: bool, tmp_path: Path
) -> None:
    """Under mutual TLS too: each ranker fetches from its peers with its own identity."""
    pki = make_pki(tmp_path / "pki") if tls else None
    async with running_mesh(etcd_server.endpoint, tiny_model(), pki) as mesh:
        results = await scale_out(mesh, rng, **CHEAP)
        moved = [r for r in results if r[2] != r[1]]
        assert len(moved) >= 4, results  # the joining ranker's share, spills aside
        engine = mesh.rankers[NEW].engine
        assert engine is not None and engine.peer_fetch is not None
        fetches = engine.peer_fetch.stats.attempts
        for user, before, now, outcome in results:
            expected = (
                Outcome.CACHE_OUTCOME_PEER_FETCHED
                if now != before
                else (Outcome.CACHE_OUTCOME_HBM_HIT)
            )
            assert outcome == expected, (user, before, now, Outcome.Name(outcome), fetches)
        assert engine.peer_fetch.settings.floor_s == 2.0  # the configured floor, not 20 ms
        assert engine.peer_fetch.stats.attempts[FetchResult.HIT] == len(moved)
        assert engine.peer_fetch.stats.bytes_fetched > 0


async def test_moved_users_are_recomputed_when_fetching_is_dearer(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    async with running_mesh(etcd_server.endpoint, tiny_model()) as mesh:
        results = await scale_out(mesh, rng, **DEAR)
        moved = [r for r in results if r[2] != r[1]]
        assert len(moved) >= 4, results
        for user, before, now, outcome in results:
            expected = (
                Outcome.CACHE_OUTCOME_MISS if now != before else Outcome.CACHE_OUTCOME_HBM_HIT
            )
            assert outcome == expected, (user, before, now, Outcome.Name(outcome))
        engine = mesh.rankers[NEW].engine
        assert engine is not None and engine.peer_fetch is not None
        assert sum(engine.peer_fetch.stats.attempts.values()) == 0


async def test_a_fleet_that_started_together_stops_asking_previous_owners(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    """Three rankers start together, so each one's start is a membership change, but none
    holds anything: a ranker's cold misses ask the users' previous owners only until
    `peer_fetch_cold_asks` asks found nothing; the next change makes them ask again."""
    async with running_mesh(etcd_server.endpoint, tiny_model()) as mesh:
        for name in OLD:
            await mesh.add_ranker(name, peer_fetch_cold_asks=3, **CHEAP)
        router = await mesh.add_router()
        # Users r0 owns before and after the fourth ranker joins, each ranked once: a miss.
        mine = [u for u in (f"fresh{i}" for i in range(400)) if ranking(u, [*OLD, NEW])[0] == "r0"]
        engine = mesh.rankers["r0"].engine
        assert engine is not None and engine.peer_fetch is not None
        attempts = engine.peer_fetch.stats.attempts

        async def rank(user: str) -> None:
            request = rank_input(rng, prefix(rng, 100, user_id=user))
            reply = await router.Rank(rank_request_to_proto(request), timeout=10)
            assert (reply.instance_id, reply.cache_outcome) == ("r0", Outcome.CACHE_OUTCOME_MISS)

        for user in mine[:6]:
            await rank(user)
        assert sum(attempts.values()) == attempts[FetchResult.NOT_FOUND] == 3
        joined = await mesh.add_ranker(NEW, peer_fetch_cold_asks=3, **CHEAP)
        assert joined.mesh is not None
        r0 = mesh.rankers["r0"].mesh
        assert r0 is not None
        await poll(lambda: NEW in r0.cluster.view())
        await rank(mine[6])
        assert attempts[FetchResult.NOT_FOUND] == 4


# -- faults: a fake peer speaking the real Fetch RPC -------------------------------------------


class FaultyPeer(ranker_pb2_grpc.RankerServiceServicer):
    """Answers Fetch as `mode` says: stall (never), not_found, corrupt (one payload byte
    flipped), die (the header, then waits to be killed), other_key (a well-formed entry, but
    of another prefix it holds, under that prefix's own key)."""

    def __init__(self, model: RankingModel, mode: str) -> None:
        self.model = model
        self.mode = mode
        self.entries: dict[CacheKey, bytes] = {}
        self.headers: dict[CacheKey, ranker_pb2.PrefixHeader] = {}
        self.started = asyncio.Event()

    def hold(self, request: RankInput) -> None:
        p = request.prefix
        digest = PrefixHasher.start(p.user_features).absorb(p.long_term).digest()
        key = CacheKey(p.user_id, self.model.model_version, digest)  # type: ignore[arg-type]
        header, payload = encode(key, self.model.prefill(p))
        self.headers[key], self.entries[key] = header_to_proto(header), payload

    async def Fetch(  # type: ignore[override]
        self, request: ranker_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ranker_pb2.PrefixChunk]:
        self.started.set()
        key = CacheKey(request.user_id, request.model_version, request.prefix_digest)  # type: ignore[arg-type]
        if self.mode == "stall":
            await asyncio.Event().wait()
        if self.mode == "other_key":
            key = next(held for held in self.entries if held != key)
        if self.mode == "not_found" or key not in self.entries:
            await context.abort(grpc.StatusCode.NOT_FOUND, "not here")
        yield ranker_pb2.PrefixChunk(header=self.headers[key])
        if self.mode == "die":
            await asyncio.Event().wait()  # the test kills the server now
        payload = bytearray(self.entries[key])
        if self.mode == "corrupt":
            payload[len(payload) // 2] ^= 0x01
        for piece in chunks(bytes(payload)):
            yield ranker_pb2.PrefixChunk(data=bytes(piece))


@pytest.mark.parametrize(
    ("mode", "result"),
    [
        ("stall", FetchResult.TIMEOUT),
        ("die", FetchResult.ERROR),
        ("not_found", FetchResult.NOT_FOUND),
        ("corrupt", FetchResult.REFUSED),
    ],
)
async def test_a_failed_fetch_is_recomputed_exactly(
    etcd_server: EtcdServer, rng: np.random.Generator, mode: str, result: FetchResult
) -> None:
    model = tiny_model()
    peer = FaultyPeer(model, mode)
    server = grpc.aio.server()
    ranker_pb2_grpc.add_RankerServiceServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cfg = replace(BASE, etcd_endpoints=(etcd_server.endpoint,))
    link = connect_mesh(cfg)
    try:
        # The fake is the only other member: every user's previous owner.
        record = ranker_record("fake", f"127.0.0.1:{port}", model, COST, cfg)
        await link.cluster.register(record, 5.0)
        async with running_mesh(etcd_server.endpoint, model) as mesh:
            # Every fetch gets the 300 ms cap (the floor as in CHEAP): only the stall times out.
            fetch = {"transfer_fixed_ms": 0.01, "transfer_ms_per_mb": 0.01}
            ranker: RankerServer = await mesh.add_ranker(
                "r", fetch_timeout_ms=300, fetch_timeout_floor_ms=300, **fetch
            )
            assert ranker.mesh is not None and ranker.engine is not None
            await poll(lambda: "fake" in ranker.mesh.cluster.view())  # type: ignore[union-attr]
            request = rank_input(rng, prefix(rng, 100, user_id="moved"))
            peer.hold(request)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{ranker.port}")
            stub = ranker_pb2_grpc.RankerServiceStub(channel)
            try:
                ranked = asyncio.ensure_future(
                    stub.Rank(rank_request_to_proto(request), timeout=10)
                )
                if mode == "die":
                    await asyncio.wait_for(peer.started.wait(), 10)
                    await server.stop(0)  # mid-fetch: the header sent, the payload not
                reply = await ranked
            finally:
                await channel.close()
            assert reply.cache_outcome == Outcome.CACHE_OUTCOME_MISS
            assert_exact(model, reply, request)
            fetch_stats = ranker.engine.peer_fetch
            assert fetch_stats is not None and dict(fetch_stats.stats.attempts) == {result: 1}
            usage = ranker.engine.store.usage(Tier.HBM)
            assert usage.used_bytes <= usage.budget_bytes and ranker.engine.inflight() == 0
    finally:
        await link.close()
        await server.stop(0)


async def test_the_fetch_client_refuses_an_entry_of_another_prefix(
    rng: np.random.Generator,
) -> None:
    """The gRPC PeerSource on its own (before the engine's own check): a peer that streams a
    complete, uncorrupted entry of the asked-for size but under another prefix's key is
    refused; the same peer asked for what it sends is believed."""
    model = tiny_model()
    asked, sent = (rank_input(rng, prefix(rng, 100, user_id=u)) for u in ("moved", "other"))
    peer = FaultyPeer(model, "other_key")
    peer.hold(sent)
    server = grpc.aio.server()
    ranker_pb2_grpc.add_RankerServiceServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = RankerPool([], PLAINTEXT)
    try:
        source = GrpcPeerSource(pool, dict, None, "me", model.cfg, model.device)
        fake = Peer("fake", f"127.0.0.1:{port}")
        (sent_key,) = peer.entries
        p = asked.prefix
        digest = PrefixHasher.start(p.user_features).absorb(p.long_term).digest()
        asked_key = CacheKey(p.user_id, model.model_version, digest)  # type: ignore[arg-type]
        assert peer.headers[sent_key].nbytes == 104 * model.cfg.cache_bytes_per_token
        assert await source.fetch(asked_key, fake, 5.0) == FetchResult.REFUSED
        # The same stream, asked for under its own key, passes every check.
        peer.mode = "serve"
        got = await source.fetch(sent_key, fake, 5.0)
        assert isinstance(got, Fetched) and got.kv.digest == sent_key.digest
    finally:
        await pool.close()
        await server.stop(0)


async def test_fetch_streams_a_held_prefix_and_refuses_what_it_does_not_hold(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    """The Fetch RPC itself: a held prefix streams back in full; another digest is NOT_FOUND; a
    request without a key is INVALID_ARGUMENT; Describe reports the transfer cost."""
    async with running_mesh(etcd_server.endpoint, tiny_model()) as mesh:
        ranker = await mesh.add_ranker("r", transfer_fixed_ms=3.0, transfer_ms_per_mb=0.5)
        request = rank_input(rng, prefix(rng, 100, user_id="held"))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{ranker.port}")
        stub = ranker_pb2_grpc.RankerServiceStub(channel)
        try:
            await stub.Rank(rank_request_to_proto(request), timeout=10)
            p = request.prefix
            digest = PrefixHasher.start(p.user_features).absorb(p.long_term).digest()
            version = mesh.model.model_version
            parts = [
                part
                async for part in stub.Fetch(
                    ranker_pb2.FetchRequest(
                        user_id="held", model_version=version, prefix_digest=digest
                    ),
                    timeout=10,
                )
            ]
            header = parts[0].header
            assert header.num_tokens == 104 and header.prefix_digest == digest
            assert sum(len(part.data) for part in parts[1:]) == header.nbytes
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                async for _ in stub.Fetch(
                    ranker_pb2.FetchRequest(
                        user_id="held", model_version=version, prefix_digest="0" * 32
                    )
                ):
                    pass
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                async for _ in stub.Fetch(ranker_pb2.FetchRequest(user_id="held")):
                    pass
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            info = await stub.Describe(ranker_pb2.DescribeRequest())
            assert (info.cost_model.transfer_fixed_ms, info.cost_model.transfer_ms_per_mb) == (
                3.0,
                0.5,
            )
        finally:
            await channel.close()
