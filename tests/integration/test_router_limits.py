"""Router limits on loopback: the load bound under skewed traffic, bad input, oversized messages."""

import math
import time
from collections import Counter
from typing import Any

import grpc
import numpy as np
import pytest

from relaygr.behaviours import Prefix, RankInput
from relaygr.cluster import PlacementRecord
from relaygr.placement import Reason, ranking
from relaygr.v1 import common_pb2, ranker_pb2_grpc
from relaygr.wire import pre_infer_request_to_proto, rank_request_to_proto
from services.router.forward import RouterStats
from tests.integration.etcd_server import EtcdServer
from tests.integration.mesh_harness import running_mesh
from tests.integration.ranker_harness import BASE, poll, reverse_timestamp, tiny_model
from tests.unit.ranker.factories import prefix, rank_input, rel_err

HIT = common_pb2.CACHE_OUTCOME_HBM_HIT


def _scores(reply: common_pb2.RankReply) -> np.ndarray:
    return np.array([list(t.scores) for t in reply.scores])


def _placements(stats: RouterStats) -> Counter[str]:
    """The router's PreInfer placements by reason."""
    return Counter({reason.value: stats.placed[reason] for reason in Reason})


def _placed_nothing(stats: RouterStats) -> bool:
    """No request placed, failed over or hedged, no directory write (Ranks may be routed)."""
    return not (
        stats.placed
        or stats.placed_random
        or stats.failed_over
        or stats.hedged
        or stats.directory_writes
        or stats.directory_write_failures
    )


def _bound(total: int, n: int, epsilon: float, floor: float) -> int:
    """placement.load_bound, written out: ceil((1 + eps) * max(mean, floor)), `total` counting
    the user being placed."""
    return math.ceil((1 + epsilon) * max(total / n, floor))


async def test_zipf_traffic_never_pushes_a_ranker_past_the_load_bound(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    """Bounded load: under a Zipf user population no ranker passes the load bound, and spilled
    users still meet their cache.

    Each PreInfer is checked against placement.py's rule, written out here: a directory entry
    wins while its instance's load + 1 is within the bound; otherwise (no entry, or the entry's
    instance is full) the first instance of the user's ranking with room takes it. So no ranker
    ever passes the bound, hot users included. PreInfers are sent one at a time: the router
    reads the loads, places, then counts, so concurrent PreInfers could each see the same loads
    and overshoot together.

    Each PreInfer's directory write is checked against `directory_write`'s rule: on the hash
    owner only to overwrite an entry naming another instance; elsewhere when the entry is
    missing, names another instance, or expires within half a window. A hot user's repeated
    PreInfers therefore do not rewrite etcd.
    """
    model = tiny_model()
    names = ["r0", "r1", "r2"]
    # At epsilon 0.25 about 1% of Zipf draws spill nobody (hashing happens to spread the hot
    # users); at 0.1 every one of 20,000 simulated draws spilled (and re-placed) some.
    epsilon, floor = 0.1, 2.0
    window_s = 600.0  # longer than the test: no load or entry expires, no entry is refreshed
    popularity = np.arange(1, 801) ** -1.1
    users = [f"zipf{k}" for k in rng.choice(800, size=400, p=popularity / popularity.sum())]
    tokens = 4 + 12  # user features + long-term behaviours of each prefix
    # Every prefix stays resident: nothing is evicted, so every Rank can be an HBM hit.
    assert len(users) * tokens * (model.cfg.kv_bytes_per_token + 8) < BASE.hbm_budget_bytes

    def write_due(served: str, owner: str, entry: PlacementRecord | None, now: float) -> bool:
        """directory_write's documented rule, written out."""
        if entry is None:
            return served != owner
        if served == owner:
            return entry.instance_id != served
        return entry.instance_id != served or entry.expires_at - now < window_s / 2

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        for name in names:
            await mesh.add_ranker(name)
        config: dict[str, Any] = dict(
            load_epsilon=epsilon, load_floor=floor, relay_window_ms=int(window_s * 1e3)
        )
        a, b = await mesh.add_router(**config), await mesh.add_router(**config)
        router_a, router_b = mesh.routers
        servicer, cluster = router_a.servicer, router_a.cluster
        last: dict[str, tuple[str, Prefix]] = {}
        directory: dict[str, str] = {}  # the entries the writes so far leave, kept here
        writes_due = pinned = pinned_writes = yielded = yielded_to_owner = 0
        for step, user in enumerate(users):
            before = Counter(servicer.load.loads())
            placed = _placements(servicer.stats)
            puts = cluster.writes["put"]
            entry = cluster.entry(user, model.model_version)
            assert (None if entry is None else entry.instance_id) == directory.get(user)
            start = time.time()
            p = prefix(rng, 12, user_id=user)  # the user's history moves on: a new prefix
            reply = await a.PreInfer(pre_infer_request_to_proto(p))
            end = time.time()
            chosen = reply.instance_id
            last[user] = (chosen, p)
            after = Counter(servicer.load.loads())
            assert after == before + Counter([chosen]), (step, before, after, chosen)
            reasons = list((_placements(servicer.stats) - placed).elements())
            order = ranking(user, names)
            bound = _bound(before.total() + 1, len(names), epsilon, floor)
            where = (step, user, order, entry, dict(before), bound)
            if entry is not None and before[entry.instance_id] + 1 <= bound:
                assert (chosen, reasons) == (entry.instance_id, ["directory"]), where
            else:
                yielded += entry is not None  # its instance is full: placed afresh
                yielded_to_owner += entry is not None and chosen == order[0]
                room = [inst for inst in order if before[inst] + 1 <= bound]
                assert room, f"the ceiling leaves room below {bound}: {before}"
                assert chosen == room[0], where
                assert reasons == ["hash" if chosen == order[0] else "spilled"], where
            assert max(after[inst] for inst in names) <= bound, (where, dict(after))
            # The router decides between start and end; far from an expiry, both agree.
            due = write_due(chosen, order[0], entry, start)
            assert due == write_due(chosen, order[0], entry, end), where
            assert cluster.writes["put"] - puts == due, (where, chosen)
            if due:
                directory[user] = chosen
            writes_due += due
            pinned += entry is not None
            pinned_writes += entry is not None and due
        stats = servicer.stats
        writes = cluster.writes["put"]
        print(
            f"placements {dict(stats.placed)}; {writes} directory writes for {len(users)} "
            f"PreInfers, {pinned} of them pinned by the directory ({yielded} of those "
            f"found their instance full, {pinned_writes} wrote)"
        )
        assert stats.placed[Reason.SPILLED] > 0 and stats.placed[Reason.DIRECTORY] > 0
        assert writes == writes_due == stats.directory_writes
        # A PreInfer that followed the directory wrote nothing; one whose entry's instance
        # was full moved its user, and wrote. The other writes are the spills.
        assert pinned_writes == yielded
        assert writes == stats.placed[Reason.SPILLED] + yielded_to_owner
        # So hot users' repeated PreInfers do not each write: in 20,000 simulated draws
        # pinned PreInfers outnumbered writes at least 1.5 to 1 (7.6 to 1 at the median).
        assert writes < pinned, (writes, pinned)

        # A user on its hash owner has no entry or one naming the owner; one elsewhere
        # has an entry naming where it is: router b's Ranks find every cache.
        for user, (instance, _) in last.items():
            assert directory.get(user, ranking(user, names)[0]) == instance, user
        await poll(
            lambda: all(
                router_b.cluster.lookup(u, model.model_version) == directory.get(u) for u in last
            )
        )
        for user, (instance, p) in last.items():
            request = rank_input(rng, p, 2, 3)
            ranked = await b.Rank(rank_request_to_proto(request))
            assert (ranked.instance_id, ranked.cache_outcome) == (instance, HIT), user
            assert rel_err(_scores(ranked), model.full_forward(request).numpy()) <= 1e-5


async def test_bad_input_gets_the_rankers_status_through_the_router(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    """The ranker's INVALID_ARGUMENT reaches the client unchanged, and occupies no ranker in the
    router's load; a message over the router's own limit is refused by the router."""
    model = tiny_model(max_candidates=16, max_history_tokens=600)

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        ranker = await mesh.add_ranker("r0")
        router = await mesh.add_router(max_message_mb=1)
        servicer = mesh.routers[0].servicer
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{ranker.port}")
        direct = ranker_pb2_grpc.RankerServiceStub(channel)
        good = rank_input(rng, prefix(rng, 50), n_candidates=4)
        long = RankInput(prefix(rng, 646), good.short_term, good.candidates, good.request_ts)

        def bad(request: RankInput, **changes: object) -> list[tuple[str, Any]]:
            """Rank and PreInfer (only where the changed fields are a PreInferRequest's too)
            with `changes`; `reversed` names the behaviours whose timestamps[3] goes back."""
            messages: list[tuple[str, Any]] = [("Rank", rank_request_to_proto(request))]
            if "candidate_ids" not in changes and changes.get("reversed") != "short_term":
                messages.append(("PreInfer", pre_infer_request_to_proto(request.prefix)))
            for _, msg in messages:
                for name, value in changes.items():
                    if name == "ragged":
                        del msg.long_term.actions[-1]
                    elif name == "reversed":
                        reverse_timestamp(getattr(msg, str(value)), str(value), 3)
                    elif isinstance(value, list):
                        getattr(msg, name)[:] = value
                    else:
                        setattr(msg, name, value)
            return messages

        invalid = {
            "user_id must not be empty": bad(good, user_id=""),
            "ragged behaviour arrays": bad(good, ragged=True),
            "long_term.timestamps[3] = ": bad(good, reversed="long_term"),
            "short_term.timestamps[3] = ": bad(good, reversed="short_term"),
            "650 tokens": bad(long),
            "17 candidates exceed the limit of 16": bad(good, candidate_ids=list(range(17))),
            "at least one candidate": bad(good, candidate_ids=[]),
            "user_id is longer than 256 bytes": bad(good, user_id="x" * 300),
        }
        try:
            for message, requests in invalid.items():
                for method, request in requests:
                    with pytest.raises(grpc.aio.AioRpcError) as own:
                        await getattr(direct, method)(request)
                    with pytest.raises(grpc.aio.AioRpcError) as routed:
                        await getattr(router, method)(request)
                    assert own.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
                    assert message in (own.value.details() or ""), own.value.details()
                    status = (routed.value.code(), routed.value.details())
                    assert status == (own.value.code(), own.value.details()), method
        finally:
            await channel.close()
        assert not servicer.load.loads() and _placed_nothing(servicer.stats)  # nothing placed
        # Over the router's 1 MiB limit (the ranker's is 16): refused before any ranker.
        huge_rank = rank_request_to_proto(good)
        huge_rank.candidate_ids[:] = range(2**60, 2**60 + 300_000)  # 2.7 MB
        huge_pre = pre_infer_request_to_proto(prefix(rng, 100_000))  # > 1 MiB of behaviours
        for method, request in (("Rank", huge_rank), ("PreInfer", huge_pre)):
            assert request.ByteSize() > 2**20
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await getattr(router, method)(request)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, method
            assert "larger than max" in (err.value.details() or ""), err.value.details()
        assert not servicer.load.loads()
        reply = await router.Rank(rank_request_to_proto(good))
        assert reply.instance_id == "r0"
        assert rel_err(_scores(reply), model.full_forward(good).numpy()) <= 1e-5


async def test_a_request_every_ranker_refuses_as_too_large_is_resource_exhausted(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    """Within the router's limit (16 MiB) but over every ranker's (1 MiB): each ranker refuses
    with RESOURCE_EXHAUSTED, so the router answers that, not UNAVAILABLE, naming each ranker's
    answer; nothing is placed. A request within the rankers' limit is served as usual."""
    model = tiny_model()

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        for name in ("r0", "r1"):
            await mesh.add_ranker(name, max_message_mb=1)
        # Counts past the router's own token and candidate limits: only sizes are at stake.
        router = await mesh.add_router(max_message_mb=16, max_tokens=10**6, max_candidates=10**6)
        servicer = mesh.routers[0].servicer
        good = rank_input(rng, prefix(rng, 50, user_id="big"), n_candidates=4)
        huge_rank = rank_request_to_proto(good)
        huge_rank.candidate_ids[:] = range(2**60, 2**60 + 300_000)  # 2.7 MB
        huge_pre = pre_infer_request_to_proto(prefix(rng, 100_000, user_id="big"))
        for method, request in (("Rank", huge_rank), ("PreInfer", huge_pre)):
            assert 2**20 < request.ByteSize() < 16 * 2**20
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await getattr(router, method)(request)
            details = err.value.details() or ""
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (method, details)
            for name in ("r0", "r1"):
                assert f"{name}: RESOURCE_EXHAUSTED" in details, details
        assert not servicer.load.loads()
        assert not servicer.stats.placed and not servicer.stats.placed_random
        await router.PreInfer(pre_infer_request_to_proto(good.prefix))
        reply = await router.Rank(rank_request_to_proto(good))
        assert reply.cache_outcome == HIT
        assert rel_err(_scores(reply), model.full_forward(good).numpy()) <= 1e-5
