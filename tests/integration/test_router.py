"""Router + etcd + rankers on loopback: affinity, bounded load, failures, etcd outage."""

import asyncio
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from relaygr.etcd.client import EtcdClient
from relaygr.placement import Reason, ranking
from relaygr.v1 import common_pb2
from relaygr.wire import pre_infer_request_to_proto, rank_request_to_proto
from services.ranker.model import RankingModel
from tests.integration.etcd_server import EtcdServer
from tests.integration.mesh_harness import running_mesh
from tests.integration.ranker_harness import poll, tiny_model
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input, rel_err, tiny_config

HIT = common_pb2.CACHE_OUTCOME_HBM_HIT


def _scores(reply: common_pb2.RankReply) -> np.ndarray:
    return np.array([list(t.scores) for t in reply.scores])


async def test_pre_infer_and_rank_meet_across_two_routers(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    model = tiny_model()

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        for name in ("r0", "r1", "r2"):
            await mesh.add_ranker(name)
        a, b = await mesh.add_router(), await mesh.add_router()
        requests = [
            rank_input(rng, prefix(rng, 12, n_user=1, user_id=f"user{i}"), 2, 2)
            for i in range(1000)
        ]
        gate = asyncio.Semaphore(16)

        async def relay(request) -> tuple[str, str, int]:  # type: ignore[no-untyped-def]
            async with gate:
                pre = await a.PreInfer(pre_infer_request_to_proto(request.prefix))
                ranked = await b.Rank(rank_request_to_proto(request))
                return pre.instance_id, ranked.instance_id, ranked.cache_outcome

        results = await asyncio.gather(*(relay(q) for q in requests))
        same = sum(pre == ranked for pre, ranked, _ in results)
        hits = sum(outcome == HIT for _, _, outcome in results)
        assert same >= 999 and hits >= 999, f"same instance {same}/1000, hits {hits}/1000"
        assert {pre for pre, _, _ in results} == {"r0", "r1", "r2"}
        writes = sum(r.cluster.writes["put"] for r in mesh.routers)
        # Only spills are written: one write per PreInfer served away from its user's hash
        # owner, not one per request. How many spill is hashing noise past the load bound,
        # which grows as a slower host puts fewer PreInfers in each relay window: a tenth at most.
        owners = ["r0", "r1", "r2"]
        away = sum(
            pre != ranking(q.prefix.user_id, owners)[0]
            for q, (pre, _, _) in zip(requests, results, strict=True)
        )
        assert writes == away <= 100, (writes, away)


async def test_spilled_users_still_meet_their_cache(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    model = tiny_model()

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        for name in ("r0", "r1", "r2"):
            await mesh.add_ranker(name)
        a, b = await mesh.add_router(load_epsilon=0.1), await mesh.add_router()
        router_a = mesh.routers[0]
        # r0 looks overloaded to router a: its users must spill, be recorded, and be found.
        for _ in range(200):
            router_a.servicer.load.add("r0")
        requests = [rank_input(rng, prefix(rng, 12, user_id=f"u{i}"), 2, 2) for i in range(60)]
        owned = [q for q in requests if ranking(q.prefix.user_id, ["r0", "r1", "r2"])[0] == "r0"]
        assert owned
        for request in owned:
            reply = await a.PreInfer(pre_infer_request_to_proto(request.prefix))
            assert reply.instance_id != "r0"
        router_b = mesh.routers[1]
        await poll(
            lambda: all(
                router_b.cluster.lookup(q.prefix.user_id, model.model_version) for q in owned
            )
        )
        for request in owned:
            ranked = await b.Rank(rank_request_to_proto(request))
            assert ranked.cache_outcome == HIT and ranked.instance_id != "r0"
            assert rel_err(_scores(ranked), model.full_forward(request).numpy()) <= 1e-5
        assert router_a.servicer.stats.placed[Reason.SPILLED] == len(owned)


def _spawn_ranker(
    tmp_path: Path, endpoint: str, instance_id: str
) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [
            sys.executable, "-m", "tooling.cli", "ranker", "--listen", "127.0.0.1:0", "--plaintext",
            "--model", "tiny", "--model-seed", "0", "--device", "cpu",
            "--instance-id", instance_id, "--etcd-endpoints", endpoint, "--lease-ttl-s", "2",
            "--calibration-lengths", "32,64",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:
        if match := re.search(r"listening on port (\d+)", line):
            return process, int(match.group(1))
    raise AssertionError(f"ranker exited with {process.wait()}")


async def test_kill_9_between_pre_infer_and_rank_costs_a_miss_not_a_failure(
    etcd_server: EtcdServer, rng: np.random.Generator, tmp_path: Path
) -> None:
    model = RankingModel(tiny_config(), seed=0)  # the same weights as the ranker processes
    processes = dict(_spawn_ranker(tmp_path, etcd_server.endpoint, n) for n in ("p0", "p1"))
    names = dict(zip(("p0", "p1"), processes, strict=True))
    try:
        async with running_mesh(etcd_server.endpoint, model) as mesh:
            router = await mesh.add_router(converge=False)
            cluster = mesh.routers[0].cluster
            await poll(lambda: set(cluster.view()) == {"p0", "p1"}, timeout=60)
            requests = [rank_input(rng, prefix(rng, 20, user_id=f"k{i}"), 2, 3) for i in range(16)]
            placed = {}
            for request in requests:
                reply = await router.PreInfer(pre_infer_request_to_proto(request.prefix))
                placed[request.prefix.user_id] = reply.instance_id
            assert set(placed.values()) == {"p0", "p1"}
            names["p0"].send_signal(signal.SIGKILL)
            names["p0"].wait()
            killed_at = time.monotonic()
            for request in requests:
                reply = await router.Rank(rank_request_to_proto(request), timeout=10)
                assert reply.instance_id == "p1"
                expected = (
                    HIT if placed[request.prefix.user_id] == "p1" else common_pb2.CACHE_OUTCOME_MISS
                )
                assert reply.cache_outcome == expected
                assert rel_err(_scores(reply), model.full_forward(request).numpy()) <= 1e-5
            await poll(lambda: "p0" not in cluster.view(), timeout=10)
            assert time.monotonic() - killed_at <= 2.0 + 3.0  # lease TTL, plus etcd's tick
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


async def test_a_new_ranker_keeps_unmoved_users_hits(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    model = tiny_model()

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        for name in ("r0", "r1"):
            await mesh.add_ranker(name)
        router = await mesh.add_router()
        requests = [rank_input(rng, prefix(rng, 10, user_id=f"n{i}"), 2, 2) for i in range(90)]
        for request in requests:
            await router.PreInfer(pre_infer_request_to_proto(request.prefix))
        await mesh.add_ranker("r2")
        moved = 0
        for request in requests:
            user = request.prefix.user_id
            reply = await router.Rank(rank_request_to_proto(request))
            if ranking(user, ["r0", "r1", "r2"])[0] == "r2":
                moved += 1
            else:
                assert reply.cache_outcome == HIT
            assert rel_err(_scores(reply), model.full_forward(request).numpy()) <= 1e-5
        assert 0 < moved < len(requests)


async def test_serving_survives_an_etcd_outage(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    model = tiny_model()

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        for name in ("r0", "r1"):
            await mesh.add_ranker(name)
        a, b = await mesh.add_router(), await mesh.add_router()
        etcd_server.stop()
        for i in range(30):  # several seconds of traffic with etcd down: nothing fails
            request = rank_input(rng, prefix(rng, 10, user_id=f"o{i}"), 2, 2)
            await a.PreInfer(pre_infer_request_to_proto(request.prefix))
            reply = await b.Rank(rank_request_to_proto(request))
            assert reply.cache_outcome == HIT  # no spill below the load floor: affine
            assert rel_err(_scores(reply), model.full_forward(request).numpy()) <= 1e-5
        etcd_server.start()
        await mesh.add_ranker("r2")  # membership is current again, nothing restarted
        # The directory is too: a placement recorded now reaches the other router.
        router_a, router_b = mesh.routers
        for _ in range(200):
            router_a.servicer.load.add("r0")
            router_a.servicer.load.add("r1")
        request = rank_input(rng, prefix(rng, 10, user_id="after"), 2, 2)
        while ranking("after", ["r0", "r1", "r2"])[0] == "r2":
            request = rank_input(rng, prefix(rng, 10, user_id=f"after{rng.integers(1e9)}"))
        user = request.prefix.user_id

        async def spilled_and_seen() -> bool:
            reply = await a.PreInfer(pre_infer_request_to_proto(request.prefix))
            return (
                reply.instance_id == "r2"
                and router_b.cluster.lookup(user, model.model_version) == "r2"
            )

        deadline = time.monotonic() + 15
        while not await spilled_and_seen():  # the holder's lease may be renewed once more
            assert time.monotonic() < deadline, "placement never reached the other router"
            await asyncio.sleep(0.2)
        assert (await b.Rank(rank_request_to_proto(request))).cache_outcome == HIT


async def test_bad_input_and_no_ranker_statuses(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    model = tiny_model()

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        router = await mesh.add_router()
        request = rank_request_to_proto(rank_input(rng, prefix(rng, 10)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await router.Rank(request)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live ranker" in (err.value.details() or "")
        await mesh.add_ranker("r0")
        bad = rank_request_to_proto(rank_input(rng, prefix(rng, 10)))
        bad.user_id = ""
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await router.Rank(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "user_id must not be empty" in (err.value.details() or "")
        raw = mesh.channels[0].unary_unary("/relaygr.v1.RouterService/Rank")
        truncated = request.SerializeToString()[:-3]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(truncated)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid RankRequest" in (err.value.details() or ""), err.value.details()
        assert len((await router.Rank(request)).scores) == 2


async def test_expired_placements_and_departed_rankers_are_cleaned_up(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    model = tiny_model()

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        for name in ("r0", "r1"):
            await mesh.add_ranker(name)
        a = await mesh.add_router(load_epsilon=0.1, relay_window_ms=1000)
        router = mesh.routers[0]
        spilled = [f"u{i}" for i in range(40) if ranking(f"u{i}", ["r0", "r1"])[0] == "r0"]
        for user in spilled:
            for _ in range(200):  # r0 looks overloaded: its users spill to r1, recorded
                router.servicer.load.add("r0")
            await a.PreInfer(pre_infer_request_to_proto(prefix(rng, 12, user_id=user)))
        assert spilled and router.cluster.writes["put"] == len(spilled)
        client = EtcdClient([etcd_server.endpoint])
        try:

            async def directory_empty() -> bool:
                return not (await client.get_prefix("/relaygr/directory/"))[0]

            assert not await directory_empty()
            # Entries expire after one relay window; the router deletes them within another.
            await eventually(directory_empty, "expired placements deleted", timeout_s=10)
        finally:
            await client.close()
        # The router counts a delete once etcd acknowledged it, which may be just after the
        # directory was seen empty.
        await eventually(
            lambda: router.cluster.writes["delete"] == len(spilled), "each delete counted once"
        )
        assert router.cluster.writes["delete"] == len(spilled)
        await a.Rank(rank_request_to_proto(rank_input(rng, prefix(rng, 12, user_id="u0"))))
        await a.Rank(rank_request_to_proto(rank_input(rng, prefix(rng, 12, user_id="u1"))))
        assert len(router.pool.addresses()) == 2
        await mesh.rankers.pop("r0").stop(grace=0.5)  # drains and deregisters
        await mesh.converged()
        r1 = mesh.rankers["r1"].server.port
        await eventually(
            lambda: router.pool.addresses() == {f"127.0.0.1:{r1}"},
            "the departed ranker's channel closed",
            timeout_s=10,
        )


async def test_random_placement_ablation_loses_affinity_not_correctness(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    model = tiny_model()

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        for name in ("r0", "r1"):
            await mesh.add_ranker(name)
        router = await mesh.add_router(placement="random")
        outcomes = []
        for i in range(30):
            request = rank_input(rng, prefix(rng, 12, user_id=f"u{i}"), 2, 2)
            await router.PreInfer(pre_infer_request_to_proto(request.prefix))
            reply = await router.Rank(rank_request_to_proto(request))
            assert rel_err(_scores(reply), model.full_forward(request).numpy()) <= 1e-5
            outcomes.append(reply.cache_outcome)
        # each Rank meets its PreInfer's ranker only by chance (1 in 2)
        assert 0 < outcomes.count(HIT) < len(outcomes), outcomes
        assert mesh.routers[0].cluster.writes["put"] == 0  # no directory in this mode
