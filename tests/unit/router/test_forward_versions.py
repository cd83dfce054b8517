"""The forwarder with two model versions live: every request goes to the rankers of the version
chosen for it (asked for, canary, current, majority), never another, in placement, failover,
hedging and the directory."""

import dataclasses
from collections import Counter

from relaygr.cluster import MemoryCluster, PlacementRecord
from relaygr.placement import ranking
from relaygr.versions import VersionPolicy, canary_point
from services.router.forward import Forwarder
from services.router.routes import CallFailed, Refused, Route, Served
from tests.unit.router.test_forward import (
    FROZEN as FROZEN_CALL,
)
from tests.unit.router.test_forward import (
    HEDGED,
    OK,
    PRE,
    RANK,
    REQUEST,
    SETTINGS,
    UNAVAILABLE,
    WINDOW_S,
    Clock,
    Rankers,
    Rig,
    record,
    reply,
    run,
)

V1, V2 = ("r0", "r1", "r2"), ("s0", "s1")  # three rankers serve v1, two serve v2
USER = "alice"


async def two_versions(policy: VersionPolicy | None = None, settings: object = SETTINGS) -> Rig:
    clock = Clock()
    cluster = MemoryCluster(clock)
    for names, version in ((V1, "v1"), (V2, "v2")):
        for name in names:
            await cluster.register(dataclasses.replace(record(name), model_version=version), 10)
    rankers = Rankers()
    forwarder = Forwarder(
        settings,  # type: ignore[arg-type]
        cluster, cluster, rankers.connect, clock, versions=policy,
    )  # fmt: skip
    return Rig(cluster, rankers, clock, forwarder)


def test_each_request_goes_to_the_rankers_of_the_version_it_asks_for() -> None:
    async def scenario() -> None:
        r = await two_versions()
        for method in (PRE, RANK):
            for version, names in (("v1", V1), ("v2", V2)):
                route = r.forwarder.route(method, USER, model_version=version)
                assert isinstance(route, Route) and route.model_version == version
                assert route.order == tuple(ranking(USER, names)) and set(route.view) == set(names)
            # No version asked: the majority's (no policy).
            route = r.forwarder.route(method, USER)
            assert isinstance(route, Route) and route.model_version == "v1"
        assert r.forwarder.stats.versions == Counter(
            {(PRE, "v1"): 2, (PRE, "v2"): 1, (RANK, "v1"): 2, (RANK, "v2"): 1}
        )

    run(scenario)


def test_a_version_no_ranker_serves_is_unavailable_naming_it_and_the_live_ones() -> None:
    async def scenario() -> None:
        r = await two_versions()
        for method in (PRE, RANK):
            outcome = await r.forwarder.serve(method, USER, REQUEST, model_version="v3")
            assert outcome == Refused(
                UNAVAILABLE,
                "no live ranker serves model version 'v3'; live versions (rankers): v1 (3), v2 (2)",
            )
        assert r.rankers.calls == []
        assert r.forwarder.stats.version_unavailable == Counter({PRE: 1, RANK: 1})
        assert not r.forwarder.stats.versions

    run(scenario)


def test_failover_never_leaves_the_version() -> None:
    async def scenario() -> None:
        r = await two_versions()
        for name in V2:
            r.rankers.behaviour[name] = CallFailed(UNAVAILABLE, "down")
        for method in (PRE, RANK):
            outcome = await r.forwarder.serve(method, USER, REQUEST, model_version="v2")
            assert isinstance(outcome, Refused) and outcome.status is UNAVAILABLE
        assert {name for name, _ in r.rankers.called()} == set(V2)  # every v1 ranker was up

    run(scenario)


def test_a_hedge_goes_to_the_next_ranker_of_the_same_version() -> None:
    async def scenario() -> None:
        r = await two_versions(settings=HEDGED)
        order = ranking(USER, V2)
        r.rankers.behaviour[order[0]] = FROZEN_CALL
        outcome = await r.forwarder.serve(RANK, USER, REQUEST, model_version="v2")
        assert outcome == Served(reply(order[1], RANK), order[1], attempts=2, fallback=True)
        assert [name for name, _ in r.rankers.called()] == order

    run(scenario)


def test_the_directory_is_read_and_written_under_the_requests_version() -> None:
    async def scenario() -> None:
        r = await two_versions()
        owner = ranking(USER, V1)[0]
        r.rankers.behaviour[owner] = CallFailed(UNAVAILABLE, "down")
        served = await r.forwarder.serve(PRE, USER, REQUEST, model_version="v1")
        assert isinstance(served, Served) and served.instance != owner
        expires_at = r.clock.now + WINDOW_S
        assert r.cluster.entry(USER, "v1") == PlacementRecord(
            USER, served.instance, expires_at, "v1"
        )
        assert r.cluster.entry(USER, "v2") is None
        # The v1 prefix's Rank follows it; a v2 Rank never does (it hashes over v2 only).
        del r.rankers.behaviour[owner]
        v1_rank = await r.forwarder.serve(RANK, USER, REQUEST, model_version="v1")
        assert isinstance(v1_rank, Served) and v1_rank.instance == served.instance
        v2_rank = await r.forwarder.serve(RANK, USER, REQUEST, model_version="v2")
        assert isinstance(v2_rank, Served) and v2_rank.instance == ranking(USER, V2)[0]
        assert r.forwarder.stats.forwarded[RANK, OK] == 2

    run(scenario)


def test_the_canary_fraction_routes_by_the_users_canary_point_and_follows_live_config() -> None:
    async def scenario() -> None:
        r = await two_versions(VersionPolicy(current="v1", canary="v2", canary_fraction=0.25))
        users = [f"user-{i}" for i in range(400)]
        for method in (PRE, RANK):
            for user in users:
                route = r.forwarder.route(method, user)
                assert isinstance(route, Route)
                expected = "v2" if canary_point(user) < 0.25 else "v1"
                assert route.model_version == expected, user
                assert set(route.order) == set(V2 if expected == "v2" else V1)
        canaries = r.forwarder.stats.versions[PRE, "v2"]
        assert 0.15 <= canaries / len(users) <= 0.35, canaries
        r.forwarder.use_versions(VersionPolicy(current="v2"))  # the switch
        route = r.forwarder.route(RANK, users[0])
        assert isinstance(route, Route) and route.model_version == "v2"

    run(scenario)
