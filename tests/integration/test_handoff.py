"""Hand-off on drain on loopback (real etcd, real rankers and router): a draining ranker's
prefixes are hits on their next owners; a corrupt or foreign entry is refused and never served;
a receiver dying, the sender killed or a stalled call cost hits, never a Rank or a budget."""

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from relaygr.behaviours import RankInput
from relaygr.lifecycle import connect_mesh
from relaygr.placement import ranking
from relaygr.tls import open_channel
from relaygr.v1 import common_pb2, ranker_pb2, ranker_pb2_grpc, router_pb2_grpc
from relaygr.wire import pre_infer_request_to_proto, rank_request_to_proto
from services.ranker.kv_store import CacheKey
from services.ranker.model import RankingModel
from services.ranker.server import RankerServer, ranker_record
from services.ranker.transfer import Refusal, chunks, encode
from services.ranker.transfer_wire import header_to_proto
from tests.integration.etcd_server import EtcdServer
from tests.integration.mesh_harness import Mesh, running_mesh
from tests.integration.ranker_harness import BASE, COST, reply_scores, running_ranker, tiny_model
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input, rel_err
from tooling.local.certs import make_pki

HIT = common_pb2.CACHE_OUTCOME_HBM_HIT
MISS = common_pb2.CACHE_OUTCOME_MISS
RANKERS = ("r0", "r1", "r2")


def _exact(reply: common_pb2.RankReply, request: RankInput, model: RankingModel) -> None:
    assert rel_err(reply_scores(reply), model.full_forward(request).numpy()) <= 1e-5


def _users(drainer: str, per_successor: int, others: int) -> list[str]:
    """User ids: `per_successor` owned by `drainer` for each other ranker as its successor,
    and `others` owned elsewhere."""
    rest = [r for r in RANKERS if r != drainer]
    picked: dict[str, list[str]] = {r: [] for r in rest}
    plain: list[str] = []
    for i in range(10_000):
        user = f"u{i}"
        order = ranking(user, RANKERS)
        if order[0] == drainer and len(picked[order[1]]) < per_successor:
            picked[order[1]].append(user)
        elif order[0] != drainer and len(plain) < others:
            plain.append(user)
        if all(len(v) == per_successor for v in picked.values()) and len(plain) == others:
            break
    return [u for v in picked.values() for u in v] + plain


async def _warm(
    router: router_pb2_grpc.RouterServiceStub,
    rng: np.random.Generator,
    model: RankingModel,
    users: list[str],
    tokens: int,
) -> dict[str, RankInput]:
    """Each user's prefix pre-inferred and ranked (resident where it was served)."""
    requests = {}
    for user in users:
        request = rank_input(rng, prefix(rng, tokens, user_id=user), 4, 4)
        await router.PreInfer(pre_infer_request_to_proto(request.prefix))
        reply = await router.Rank(rank_request_to_proto(request))
        assert reply.cache_outcome == HIT and reply.instance_id == ranking(user, RANKERS)[0]
        _exact(reply, request, model)
        requests[user] = request
    return requests


@dataclass
class Traffic:
    """Ranks of known users through the router, one after another, until stopped: each must
    succeed with exact scores."""

    router: router_pb2_grpc.RouterServiceStub
    requests: list[RankInput]
    model: RankingModel
    rng: np.random.Generator
    served: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: "asyncio.Task[None] | None" = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            base = self.requests[int(self.rng.integers(0, len(self.requests)))]
            request = rank_input(self.rng, base.prefix, 4, 4)
            try:
                reply = await self.router.Rank(rank_request_to_proto(request), timeout=10)
                _exact(reply, request, self.model)
                self.served += 1
            except (grpc.aio.AioRpcError, AssertionError) as err:
                self.failures.append(repr(err))

    async def stop(self) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task
        assert not self.failures, self.failures[:3]
        assert self.served > 0


async def _within_budgets(mesh: Mesh) -> None:
    for ranker in mesh.rankers.values():
        async with open_channel(f"127.0.0.1:{ranker.port}", mesh.client) as channel:
            info = await ranker_pb2_grpc.RankerServiceStub(channel).Describe(
                ranker_pb2.DescribeRequest()
            )
        for tier in (info.hbm, info.dram):
            assert tier.used_bytes <= tier.budget_bytes and tier.pinned_bytes <= tier.used_bytes


async def _rank_moved(
    mesh: Mesh,
    router: router_pb2_grpc.RouterServiceStub,
    requests: dict[str, RankInput],
    moved: list[str],
    rng: np.random.Generator,
) -> dict[str, tuple[str, int]]:
    """Rank each moved user once more: (instance, cache outcome) per user, scores exact."""
    outcomes = {}
    for user in moved:
        request = rank_input(rng, requests[user].prefix, 4, 4)
        reply = await router.Rank(rank_request_to_proto(request))
        _exact(reply, request, mesh.model)
        outcomes[user] = (reply.instance_id, reply.cache_outcome)
    return outcomes


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "mutual-tls"])
async def test_a_drain_under_traffic_hands_its_prefixes_to_their_next_owners(
    etcd_server: EtcdServer, rng: np.random.Generator, tls: bool, tmp_path: Path
) -> None:
    """Under mutual TLS too, each ranker with its own identity: the receivers take the
    hand-off from a ranker identity and record the sender its certificate names."""
    model = tiny_model()
    pki = make_pki(tmp_path / "pki") if tls else None
    async with running_mesh(etcd_server.endpoint, model, pki) as mesh:
        for name in RANKERS:
            await mesh.add_ranker(name)
        router = await mesh.add_router()
        users = _users("r0", per_successor=4, others=6)
        requests = await _warm(router, rng, model, users, tokens=64)
        moved = [u for u in users if ranking(u, RANKERS)[0] == "r0"]
        traffic = Traffic(router, list(requests.values()), model, rng)
        traffic.start()
        drainer = mesh.rankers.pop("r0")
        await drainer.stop(grace=2.0)  # SIGTERM's path: NOT_SERVING, drain, stop, close
        await mesh.converged()
        await traffic.stop()
        assert drainer.handoff is not None
        sent = drainer.handoff.stats
        assert (sent.sent_entries, sent.unsent_entries, sent.failed_streams) == (len(moved), 0, 0)
        outcomes = await _rank_moved(mesh, router, requests, moved, rng)
        for user, (instance, outcome) in outcomes.items():
            assert instance == ranking(user, ["r1", "r2"])[0]
            assert outcome == HIT, (user, outcome)
        admitted = sum(
            sum(r.servicer.handoff.stats.admitted.values()) for r in mesh.rankers.values()
        )  # type: ignore[union-attr]
        assert admitted == len(moved)
        senders: Counter[str] = Counter()
        for r in mesh.rankers.values():
            senders.update(r.servicer.handoff.stats.received_from)  # type: ignore[union-attr]
        assert set(senders) == {"r0"} and senders["r0"] >= 1, senders
        await _within_budgets(mesh)


def _stream(*entries: tuple[object, bytes]) -> list[ranker_pb2.PrefixChunk]:
    out = []
    for header, payload in entries:
        out.append(ranker_pb2.PrefixChunk(header=header_to_proto(header)))  # type: ignore[arg-type]
        out += [ranker_pb2.PrefixChunk(data=bytes(p)) for p in chunks(payload, 50_000)]
    return out


async def test_a_corrupt_or_foreign_entry_is_refused_and_never_served(
    rng: np.random.Generator,
) -> None:
    model, foreign = tiny_model(), RankingModel(tiny_model().cfg, seed=8)
    assert foreign.model_version != model.model_version

    def entry(m: RankingModel, user: str) -> tuple[RankInput, tuple[object, bytes]]:
        request = rank_input(rng, prefix(rng, 200, user_id=user), 4, 4)
        kv = m.prefill(request.prefix)
        return request, encode(CacheKey(request.prefix.user_id, m.model_version, kv.digest), kv)

    good_q, good = entry(model, "good")
    flipped_q, (header, payload) = entry(model, "flipped")
    bad = bytearray(payload)
    bad[int(rng.integers(0, len(bad)))] ^= 1 << int(rng.integers(0, 8))
    foreign_q, foreign_entry = entry(foreign, "foreign")
    async with running_ranker(model) as r:
        reply = await r.stub.Handoff(iter(_stream((header, bytes(bad)), foreign_entry, good)))
        assert (reply.admitted, reply.refused) == (1, 2)
        assert list(reply.refusals) == ["flipped: corrupt", "foreign: wrong_version"]
        for request, outcome in ((flipped_q, MISS), (foreign_q, MISS), (good_q, HIT)):
            ranked = await r.stub.Rank(rank_request_to_proto(request))
            assert ranked.cache_outcome == outcome
            _exact(ranked, request, model)
        stats = r.server.servicer.handoff.stats  # type: ignore[union-attr]
        assert stats.refused[Refusal.CORRUPT] == 1 and stats.refused[Refusal.WRONG_VERSION] == 1


# -- faults --------------------------------------------------------------------------------

SLOW = {"handoff_bandwidth_mb_s": 0.5, "handoff_budget_s": 6.0}  # ~1 prefix of 400 tokens/s
TOKENS = 400


async def _slow_mesh(mesh: Mesh, rng: np.random.Generator) -> tuple[
    router_pb2_grpc.RouterServiceStub, dict[str, RankInput], list[str]
]:  # fmt: skip
    await mesh.add_ranker("r0", **SLOW)
    for name in RANKERS[1:]:
        await mesh.add_ranker(name)
    router = await mesh.add_router()
    users = _users("r0", per_successor=3, others=4)
    requests = await _warm(router, rng, mesh.model, users, TOKENS)
    return router, requests, [u for u in users if ranking(u, RANKERS)[0] == "r0"]


def _admitted(ranker: RankerServer) -> int:
    assert ranker.servicer.handoff is not None
    return sum(ranker.servicer.handoff.stats.admitted.values())


async def _hard_stop(ranker: RankerServer) -> None:
    """Gone without a drain: the server stops at once (RPCs in flight cancelled), the lease
    lapses by itself."""
    await ranker.server.stop(0)
    if ranker.membership is not None:
        await ranker.membership.close()  # without deregistering
    await ranker.engine.close()
    await ranker.close()


async def test_a_receiver_dying_mid_hand_off_costs_hits_not_ranks(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    async with running_mesh(etcd_server.endpoint, tiny_model()) as mesh:
        router, requests, moved = await _slow_mesh(mesh, rng)
        traffic = Traffic(router, list(requests.values()), mesh.model, rng)
        traffic.start()
        drainer = mesh.rankers.pop("r0")
        draining = asyncio.create_task(drainer.stop(grace=8.0))
        await eventually(lambda: _admitted(mesh.rankers["r1"]) >= 1, "r1 took a first prefix")
        victim = mesh.rankers.pop("r1")
        await _hard_stop(victim)
        await asyncio.wait_for(draining, timeout=15)
        await mesh.converged()
        await traffic.stop()
        assert drainer.handoff is not None and drainer.handoff.stats.failed_streams == 1
        outcomes = await _rank_moved(mesh, router, requests, moved, rng)
        assert all(instance == "r2" for instance, _ in outcomes.values())
        await _within_budgets(mesh)


async def test_a_sender_killed_mid_stream_leaves_no_partial_entry(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    async with running_mesh(etcd_server.endpoint, tiny_model()) as mesh:
        router, requests, moved = await _slow_mesh(mesh, rng)
        # Traffic of the users staying put: a moved user's miss would cache its prefix anew.
        others = [q for u, q in requests.items() if u not in moved]
        traffic = Traffic(router, others, mesh.model, rng)
        traffic.start()
        drainer = mesh.rankers.pop("r0")
        draining = asyncio.create_task(drainer.drain(8.0))
        receivers = list(mesh.rankers.values())
        await eventually(lambda: sum(map(_admitted, receivers)) >= 1, "a first prefix taken")
        draining.cancel()  # killed mid-stream: its streams are cut, nothing more is sent
        with contextlib.suppress(asyncio.CancelledError):
            await draining
        await _hard_stop(drainer)
        await eventually(
            lambda: all(r.servicer.handoff.streams == 0 for r in receivers),  # type: ignore[union-attr]
            "the cut streams ended on their receivers",
        )
        await mesh.converged()
        await traffic.stop()
        taken = sum(map(_admitted, receivers))
        assert 1 <= taken < len(moved)
        outcomes = await _rank_moved(mesh, router, requests, moved, rng)
        hits = [u for u, (_, outcome) in outcomes.items() if outcome == HIT]
        assert len(hits) == taken  # the admitted ones are hits; a partial one was never stored
        await _within_budgets(mesh)


async def test_a_stalled_receiver_times_out_and_the_drain_goes_on(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)  # takes the connection, never answers, until the caller leaves
        writer.close()

    stalled = await asyncio.start_server(stall, "127.0.0.1", 0)
    address = f"127.0.0.1:{stalled.sockets[0].getsockname()[1]}"
    model = tiny_model()
    async with running_mesh(etcd_server.endpoint, model) as mesh:
        await mesh.add_ranker("r0", handoff_budget_s=1.0)
        await mesh.add_ranker("r1")
        router = await mesh.add_router()
        # "r2" is a ranker that accepts connections and never answers.
        link = connect_mesh(replace(BASE, etcd_endpoints=(etcd_server.endpoint,)))
        await link.cluster.register(ranker_record("r2", address, model, COST, BASE), 2.0)
        try:
            users = _users("r0", per_successor=3, others=0)
            to_r1 = [u for u in users if ranking(u, RANKERS)[1] == "r1"]
            requests = {}
            for user in users:
                request = rank_input(rng, prefix(rng, 64, user_id=user), 4, 4)
                await mesh.rankers["r0"].engine.pre_infer(request.prefix, None, None)  # type: ignore[union-attr]
                requests[user] = request
            drainer = mesh.rankers.pop("r0")
            await eventually(lambda: "r2" in drainer.mesh.cluster.view(), "r0 sees r2")  # type: ignore[union-attr]
            started = asyncio.get_running_loop().time()
            await drainer.stop(grace=2.0)
            assert asyncio.get_running_loop().time() - started < 5.0  # the budget, not the stall
            assert drainer.handoff is not None and drainer.handoff.stats.failed_streams == 1
            assert _admitted(mesh.rankers["r1"]) == len(to_r1)
        finally:
            await link.cluster.deregister("r2")
            await link.close()
            stalled.close()
        await mesh.converged()
        for user in to_r1:
            request = rank_input(rng, requests[user].prefix, 4, 4)
            reply = await router.Rank(rank_request_to_proto(request))
            assert (reply.instance_id, reply.cache_outcome) == ("r1", HIT)
            _exact(reply, request, model)
        await _within_budgets(mesh)
