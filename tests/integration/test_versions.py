"""Two model versions side by side behind one router on real etcd: each Rank is scored exactly by
the version it asked for, a prefix is never consumed under another version, a canary fraction
routes as the live config says, and a ranker refuses a request for another version."""

import json

import grpc
import numpy as np
import pytest

from relaygr.etcd.client import EtcdClient
from relaygr.tls import open_channel
from relaygr.tls_settings import PLAINTEXT
from relaygr.v1 import common_pb2, ranker_pb2_grpc, trigger_pb2
from relaygr.versions import VersionPolicy, canary_point, versions_key
from relaygr.wire import behaviours_to_proto, pre_infer_request_to_proto, rank_request_to_proto
from services.ranker.model import RankingModel
from services.router.routes import Method
from tests.integration.etcd_server import EtcdServer
from tests.integration.mesh_harness import Mesh, running_mesh
from tests.integration.ranker_harness import reply_scores, tiny_model
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input, rel_err, tiny_config

HIT, MISS = common_pb2.CACHE_OUTCOME_HBM_HIT, common_pb2.CACHE_OUTCOME_MISS
V1_SET, V2_SET = ("a0", "a1"), ("b0", "b1")


async def two_sets(mesh: Mesh, v2_model: RankingModel) -> None:
    """Rankers a0, a1 serve the mesh's model (v1); b0, b1 serve `v2_model`."""
    for name in V1_SET:
        await mesh.add_ranker(name)
    for name in V2_SET:
        await mesh.add_ranker(name, ranking_model=v2_model)


def rank(request, version: str = "") -> common_pb2.RankRequest:  # type: ignore[no-untyped-def]
    message = rank_request_to_proto(request)
    message.model_version = version
    return message


async def test_two_versions_through_one_router_score_exactly_by_the_version_asked_for(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    v1_model, v2_model = tiny_model(), RankingModel(tiny_config(), seed=8)
    v1, v2 = v1_model.model_version, v2_model.model_version
    assert v1 != v2
    models, sets = {v1: v1_model, v2: v2_model}, {v1: V1_SET, v2: V2_SET}
    async with running_mesh(etcd_server.endpoint, v1_model) as mesh:
        await two_sets(mesh, v2_model)
        router = await mesh.add_router()
        # Two rankers each: the majority is a tie, won by the greater version string.
        default = max(v1, v2)
        for i in range(4):
            request = rank_input(rng, prefix(rng, 12, user_id=f"u{i}"), 2, 3)
            for asked, version in ((v1, v1), (v2, v2), ("", default)):
                reply = await router.Rank(rank(request, asked))
                assert reply.model_version == version and reply.instance_id in sets[version]
                full = models[version].full_forward(request).numpy()
                assert rel_err(reply_scores(reply), full) <= 1e-5

        # A prefix pre-inferred under v1 is never consumed by a v2 Rank, and still is by v1's.
        request = rank_input(rng, prefix(rng, 12, user_id="relayed"), 2, 3)
        pre = pre_infer_request_to_proto(request.prefix)
        pre.model_version = v1
        pre_reply = await router.PreInfer(pre)
        assert pre_reply.model_version == v1 and pre_reply.instance_id in V1_SET
        v2_reply = await router.Rank(rank(request, v2))
        assert v2_reply.cache_outcome == MISS and v2_reply.instance_id in V2_SET
        assert v2_reply.model_version == v2
        assert rel_err(reply_scores(v2_reply), v2_model.full_forward(request).numpy()) <= 1e-5
        v1_reply = await router.Rank(rank(request, v1))
        assert (v1_reply.cache_outcome, v1_reply.instance_id) == (HIT, pre_reply.instance_id)
        assert rel_err(reply_scores(v1_reply), v1_model.full_forward(request).numpy()) <= 1e-5

        # A version no ranker serves is UNAVAILABLE, naming it.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await router.Rank(rank(request, "v-none"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live ranker serves model version 'v-none'" in (err.value.details() or "")
        stats = mesh.routers[0].servicer.stats
        by_default = 4 if default == v2 else 0
        assert stats.versions[Method.RANK, v2] == 5 + by_default
        assert stats.versions[Method.PRE_INFER, v1] == 1
        assert stats.version_unavailable[Method.RANK] == 1

        # A ranker asked directly for another version refuses, naming both.
        channel = open_channel(f"127.0.0.1:{mesh.rankers['a0'].port}", PLAINTEXT)
        try:
            ranker = ranker_pb2_grpc.RankerServiceStub(channel)
            for call, message in ((ranker.Rank, rank(request, v2)), (ranker.PreInfer, pre)):
                message.model_version = v2
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(message)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert v1 in (err.value.details() or "") and v2 in (err.value.details() or "")
        finally:
            await channel.close()


async def test_a_canary_fraction_routes_by_live_config_and_the_trigger_relays_per_version(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    v1_model, v2_model = tiny_model(), RankingModel(tiny_config(), seed=8)
    v1, v2 = v1_model.model_version, v2_model.model_version
    async with running_mesh(etcd_server.endpoint, v1_model) as mesh:
        await two_sets(mesh, v2_model)
        router = await mesh.add_router()
        trigger = await mesh.add_trigger(mode="all")
        served_router, served_trigger = mesh.routers[0], mesh.triggers[0]
        client = EtcdClient([etcd_server.endpoint])
        try:
            key = versions_key("/relaygr")
            policy = VersionPolicy(current=v1, canary=v2, canary_fraction=0.3)
            await client.put(key, policy.to_json())
            await eventually(
                lambda: served_router.versions.current == served_trigger.versions.current == policy,
                "the policy applied by the router and the trigger",
            )
            users = [f"user-{i}" for i in range(60)]
            canaries = 0
            for user in users:
                request = rank_input(rng, prefix(rng, 8, user_id=user), 1, 2)
                reply = await router.Rank(rank(request))
                canary = canary_point(user) < 0.3
                canaries += canary
                assert reply.model_version == (v2 if canary else v1), user
                full = (v2_model if canary else v1_model).full_forward(request).numpy()
                assert rel_err(reply_scores(reply), full) <= 1e-5
            # 60 draws of p = 0.3: 3.4 standard deviations either side.
            assert 0.1 <= canaries / len(users) <= 0.5, canaries

            # The trigger chooses as the router does, and its relay names the version.
            canary_user = next(u for u in users if canary_point(u) < 0.3)
            p = prefix(rng, 12, user_id=canary_user)
            event = trigger_pb2.RetrievalEvent(
                request_id="e", user_id=canary_user, user_features=p.user_features.tolist(),
                long_term=behaviours_to_proto(p.long_term), expected_candidates=2,
                expected_short_term=1,
            )  # fmt: skip
            decision = await trigger.OnRetrieval(event)
            assert decision.admitted and decision.model_version == v2
            assert decision.target_instance in V2_SET
            await eventually(lambda: served_trigger.servicer.stats.relayed == 1, "relayed")
            request = rank_input(rng, p, 1, 2)
            reply = await router.Rank(rank(request))
            assert (reply.model_version, reply.cache_outcome) == (v2, HIT)
            assert rel_err(reply_scores(reply), v2_model.full_forward(request).numpy()) <= 1e-5
            # Asked for v1 explicitly, the same event is judged and relayed under v1.
            event.model_version = v1
            decision = await trigger.OnRetrieval(event)
            assert decision.admitted and decision.model_version == v1
            assert decision.target_instance in V1_SET

            # A bad value is refused and the policy kept; deleting the key restores the default.
            await client.put(key, json.dumps({"canary_fraction": 2}).encode())
            live = served_router.versions
            await eventually(lambda: live.rejected == 1, "the bad policy rejected")
            assert live.current == policy
            await client.delete(key)
            await eventually(lambda: live.current == VersionPolicy(), "back to the default")
        finally:
            await client.close()
