"""Admission and placement that agree (issue 16): etcd, a router, three rankers and a trigger.

Every long user hashes to the same ranker, whose device tier holds two of their relays. The
sequence-aware trigger walks each user's fallback order and sends the relay where there is room,
so every at-risk user is relayed, every Rank is an HBM hit and no ranker refuses a relay on the
way; relaying everything fills the tiers with short users' relays and long users are refused.
"""

import numpy as np
import pytest

from relaygr.placement import ranking
from relaygr.v1 import common_pb2, trigger_pb2
from relaygr.wire import rank_request_to_proto
from services.ranker.kv_store import Tier
from tests.integration.etcd_server import EtcdServer
from tests.integration.mesh_harness import running_mesh
from tests.integration.ranker_harness import tiny_model
from tests.integration.test_trigger import LONG, SLO, _event
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input

RANKERS = ("r0", "r1", "r2")
MEDIUM = 200  # not at risk (~3.4 ms predicted against 7 ms), yet a sizeable relay
Reason = trigger_pb2.AdmissionReason


def _users(prefix_: str, count: int, owner: str | None = None) -> list[str]:
    """`count` user ids, all owned by `owner` (None: any) in the rendezvous order."""
    found, n = [], 0
    while len(found) < count:
        user = f"{prefix_}{n}"
        n += 1
        if owner is None or ranking(user, RANKERS)[0] == owner:
            found.append(user)
    return found


@pytest.mark.parametrize("mode", ["sequence-aware", "all"])
async def test_a_burst_lands_where_there_is_room(
    etcd_server: EtcdServer, rng: np.random.Generator, mode: str
) -> None:
    model = tiny_model()
    relay_bytes = (LONG + 4) * model.cfg.cache_bytes_per_token
    budget_mb = 2.5 * relay_bytes / 2**20  # two long relays (90%: 2.25 of them) per ranker
    longs = [prefix(rng, LONG, user_id=u) for u in _users("long", 5, owner="r0")]
    mediums = [prefix(rng, MEDIUM, user_id=u) for u in _users("medium", 12)]

    async with running_mesh(etcd_server.endpoint, model) as mesh:
        for name in RANKERS:
            await mesh.add_ranker(name, hbm_budget_mb=budget_mb, max_relay_window_ms=30_000)
        router_stub = await mesh.add_router()
        # Relays of one length, one size class: the room is filled first come, first served,
        # and the mediums, not at risk, are not relayed on spare room.
        trigger = await mesh.add_trigger(
            mode=mode, relay_window_ms=20_000, relay_budget_share=0.9, relay_spare_share=0.0,
            **SLO,
        )  # fmt: skip
        servicer, router = mesh.triggers[0].servicer, mesh.routers[0].servicer
        # The user's fallback order is what the router walks: r0 first for every long user.
        for p in mediums:
            await trigger.OnRetrieval(_event(p))
        relayed = len(mediums) if mode == "all" else 0
        await eventually(
            lambda: servicer.stats.relayed + servicer.stats.refused == relayed, "mediums done"
        )
        decisions = [await trigger.OnRetrieval(_event(p)) for p in longs]
        total = relayed + len(longs)
        await eventually(
            lambda: servicer.stats.relayed + servicer.stats.refused == total, "longs done"
        )
        outcomes = []
        for p in longs:
            request = rank_input(rng, p, n_short=16, n_candidates=16)
            reply = await router_stub.Rank(rank_request_to_proto(request))
            outcomes.append(reply.cache_outcome)
        for name, ranker in mesh.rankers.items():
            assert ranker.engine is not None
            usage = ranker.engine.store.usage(Tier.HBM)
            assert usage.pinned_bytes <= usage.used_bytes <= usage.budget_bytes, name

        if mode == "sequence-aware":
            assert [d.reason for d in decisions] == [Reason.ADMISSION_REASON_ADMITTED] * 5
            targets = [d.target_instance for d in decisions]
            assert targets.count("r0") == 2 and set(targets) == set(RANKERS), targets
            assert outcomes == [common_pb2.CACHE_OUTCOME_HBM_HIT] * len(longs)
            assert servicer.stats.refused == servicer.stats.landed_elsewhere == 0
            assert router.stats.refused_then_spilled == 0  # no refusal collected on the way
        else:
            assert all(d.admitted for d in decisions)
            assert servicer.stats.refused >= 1  # long users refused everywhere: no room left
            assert outcomes.count(common_pb2.CACHE_OUTCOME_HBM_HIT) < len(longs)
