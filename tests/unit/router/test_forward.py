"""The router's forwarder without transport: placement, retry and failover, refusals, hedging and
the directory writes they cause, on the in-memory cluster with fake ranker calls."""

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from relaygr.cluster import MemoryCluster, PlacementRecord, RankerRecord
from relaygr.errors import Unavailable
from relaygr.placement import Reason, ranking
from services.router.forward import Forwarder, ForwardSettings, RouterStats
from services.router.routes import (
    NO_RANKER,
    CallFailed,
    Method,
    RankerCall,
    RankRoute,
    Refused,
    Route,
    Served,
    Status,
)
from tests.polling import eventually

NAMES = ("r0", "r1", "r2")
WINDOW_S = 2.0
SETTINGS = ForwardSettings(load_epsilon=0.25, load_floor=16.0, relay_window_s=WINDOW_S)
HEDGE_S = 0.05
USER = "alice"
MV = "mv-1"  # every ranker's model version here
ORDER = tuple(ranking(USER, NAMES))  # alice's rendezvous order: ORDER[0] owns her
REQUEST = b"\x12\x05alice"
PRE, RANK = Method.PRE_INFER, Method.RANK
OK, UNAVAILABLE, EXHAUSTED = Status.OK, Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def record(name: str) -> RankerRecord:
    return RankerRecord(
        instance_id=name,
        address=f"{name}.rankers:50051",
        model_version=MV,
        hbm_budget_bytes=2**30,
        dram_budget_bytes=2**32,
        kv_bytes_per_token=1024,
        fixed_ms=1.0,
        per_token_ms=0.001,
        per_pair_ms=1e-7,
        per_candidate_key_ms=1e-6,
        reload_ms_per_mb=0.05,
    )


def reply(name: str, method: Method) -> bytes:
    return f"{method} from {name}".encode()


FROZEN = "frozen"  # a behaviour: the call never resolves (a stopped ranker with its socket open)


@dataclass
class Rankers:
    """Fake ranker calls by instance: each answers its reply, a `CallFailed`, or never.

    `calls` lists (instance, method, request, timeout) in call order; `cancelled` the instances
    whose call was cancelled while it waited.
    """

    behaviour: dict[str, CallFailed | str] = field(default_factory=dict)
    calls: list[tuple[str, Method, bytes, float | None]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def connect(self, address: str, method: Method) -> RankerCall:
        name = address.split(".")[0]

        async def call(request: bytes, timeout: float | None) -> bytes | CallFailed:
            self.calls.append((name, method, request, timeout))
            behaviour = self.behaviour.get(name)
            if isinstance(behaviour, CallFailed):
                return behaviour
            if behaviour == FROZEN:
                try:
                    await asyncio.get_running_loop().create_future()
                except asyncio.CancelledError:
                    self.cancelled.append(name)
                    raise
            return reply(name, method)

        return call

    def called(self) -> list[tuple[str, Method]]:
        return [(name, method) for name, method, _, _ in self.calls]


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    cluster: MemoryCluster
    rankers: Rankers
    clock: Clock
    forwarder: Forwarder


async def rig(
    settings: ForwardSettings = SETTINGS,
    names: tuple[str, ...] = NAMES,
    draw: Callable[[int], int] | None = None,
    cluster: MemoryCluster | None = None,
) -> Rig:
    clock = Clock()
    cluster = cluster or MemoryCluster(clock)
    for name in names:
        await cluster.register(record(name), ttl_s=10)
    rankers = Rankers()
    forwarder = Forwarder(settings, cluster, cluster, rankers.connect, clock, draw)
    return Rig(cluster, rankers, clock, forwarder)


# -- placement and its books ---------------------------------------------------------------


def test_a_pre_infer_goes_to_its_owner_and_is_booked_there() -> None:
    async def scenario() -> None:
        r = await rig()
        route = r.forwarder.route(PRE, USER)
        assert isinstance(route, Route)
        assert (route.order, route.reason, route.known) == (ORDER, Reason.HASH, None)
        assert route.placement is not None and route.placement.owner == ORDER[0]
        outcome = await r.forwarder.serve(PRE, USER, REQUEST, lambda: 4.5)
        assert outcome == Served(reply(ORDER[0], PRE), ORDER[0], attempts=1, fallback=False)
        assert r.rankers.calls == [(ORDER[0], PRE, REQUEST, 4.5)]
        assert r.forwarder.stats == RouterStats(
            placed=Counter({Reason.HASH: 1}),
            forwarded=Counter({(PRE, OK): 1}),
            versions=Counter({(PRE, MV): 2}),  # routed twice (`route`, then `serve`)
        )
        assert r.forwarder.load.loads() == Counter({ORDER[0]: 1})
        assert r.cluster.entry(USER, MV) is None  # on its owner: nothing to tell the directory

    run(scenario)


def test_an_unavailable_owner_fails_over_and_the_directory_learns_where_the_user_went() -> None:
    async def scenario() -> None:
        r = await rig()
        r.rankers.behaviour[ORDER[0]] = CallFailed(UNAVAILABLE, "connection refused")
        outcome = await r.forwarder.serve(PRE, USER, REQUEST)
        assert outcome == Served(reply(ORDER[1], PRE), ORDER[1], attempts=2, fallback=True)
        assert r.rankers.called() == [(ORDER[0], PRE), (ORDER[1], PRE)]
        assert r.forwarder.stats == RouterStats(
            placed=Counter({Reason.HASH: 1}),
            failed_over=Counter({PRE: 1}),
            forwarded=Counter({(PRE, UNAVAILABLE): 1, (PRE, OK): 1}),
            directory_writes=1,
            versions=Counter({(PRE, MV): 1}),
        )
        assert r.forwarder.load.loads() == Counter({ORDER[1]: 1})  # where it was served
        assert r.cluster.entry(USER, MV) == PlacementRecord(
            USER, ORDER[1], r.clock.now + WINDOW_S, MV
        )

        # The user's Rank follows the directory to where the PreInfer landed, at first try.
        route = r.forwarder.route(RANK, USER)
        assert isinstance(route, Route)
        assert (route.order[0], route.reason) == (ORDER[1], RankRoute.DIRECTORY)
        ranked = await r.forwarder.serve(RANK, USER, REQUEST)
        assert ranked == Served(reply(ORDER[1], RANK), ORDER[1], attempts=1, fallback=False)
        assert r.forwarder.stats.rank_routes == Counter({RankRoute.DIRECTORY: 2})

    run(scenario)


def test_a_ranker_without_room_spills_the_request_to_the_next_one() -> None:
    async def scenario() -> None:
        r = await rig()
        r.rankers.behaviour[ORDER[0]] = CallFailed(EXHAUSTED, "HBM full")
        outcome = await r.forwarder.serve(PRE, USER, REQUEST)
        assert outcome == Served(reply(ORDER[1], PRE), ORDER[1], attempts=2, fallback=True)
        assert r.forwarder.stats.forwarded == Counter({(PRE, EXHAUSTED): 1, (PRE, OK): 1})
        assert r.forwarder.stats.failed_over == Counter({PRE: 1})
        assert r.cluster.lookup(USER, MV) == ORDER[1]

    run(scenario)


def test_every_ranker_without_room_is_resource_exhausted_naming_each_answer() -> None:
    async def scenario() -> None:
        r = await rig()
        for name in NAMES:
            r.rankers.behaviour[name] = CallFailed(EXHAUSTED, f"{name} is full")
        outcome = await r.forwarder.serve(PRE, USER, REQUEST)
        expected = "no ranker could serve PreInfer: " + "; ".join(
            f"{name}: RESOURCE_EXHAUSTED {name} is full" for name in ORDER
        )
        assert outcome == Refused(EXHAUSTED, expected)
        assert r.rankers.called() == [(name, PRE) for name in ORDER]
        # Nothing placed: no load, no placement count, no directory write.
        assert r.forwarder.stats == RouterStats(
            forwarded=Counter({(PRE, EXHAUSTED): 3}), versions=Counter({(PRE, MV): 1})
        )
        assert not r.forwarder.load.loads() and r.cluster.entry(USER, MV) is None

    run(scenario)


def test_a_refusal_for_room_among_unavailable_rankers_is_unavailable() -> None:
    async def scenario() -> None:
        r = await rig()
        r.rankers.behaviour[ORDER[0]] = CallFailed(EXHAUSTED, "too large")
        for name in ORDER[1:]:
            r.rankers.behaviour[name] = CallFailed(UNAVAILABLE, None)
        outcome = await r.forwarder.serve(RANK, USER, REQUEST)
        assert outcome == Refused(
            UNAVAILABLE,
            f"no ranker could serve Rank: {ORDER[0]}: RESOURCE_EXHAUSTED too large; "
            f"{ORDER[1]}: UNAVAILABLE None; {ORDER[2]}: UNAVAILABLE None",
        )
        assert r.forwarder.stats.forwarded == Counter(
            {(RANK, EXHAUSTED): 1, (RANK, UNAVAILABLE): 2}
        )
        assert r.forwarder.stats.rank_routes == Counter({RankRoute.HASH: 1})

    run(scenario)


def test_a_rank_a_stopping_ranker_cancelled_is_served_by_the_next_one() -> None:
    """A ranker's stop cancels the calls it has not yet handed to a handler (grpc/grpc#41785):
    CANCELLED from a ranker is its shutdown, never the caller's, so the Rank goes on."""

    async def scenario() -> None:
        r = await rig()
        r.rankers.behaviour[ORDER[0]] = CallFailed(Status.CANCELLED, "CANCELLED")
        outcome = await r.forwarder.serve(RANK, USER, REQUEST)
        assert outcome == Served(reply(ORDER[1], RANK), ORDER[1], attempts=2, fallback=True)
        assert r.forwarder.stats.forwarded == Counter({(RANK, Status.CANCELLED): 1, (RANK, OK): 1})

    run(scenario)


def test_a_rankers_own_error_is_the_answer_without_trying_another() -> None:
    async def scenario() -> None:
        r = await rig()
        r.rankers.behaviour[ORDER[0]] = CallFailed(Status.INVALID_ARGUMENT, "ragged arrays")
        assert await r.forwarder.serve(RANK, USER, REQUEST) == Refused(
            Status.INVALID_ARGUMENT, "ragged arrays"
        )
        r.rankers.behaviour[ORDER[0]] = CallFailed(Status.DEADLINE_EXCEEDED, None)
        assert await r.forwarder.serve(PRE, USER, REQUEST) == Refused(
            Status.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"
        )
        assert r.rankers.called() == [(ORDER[0], RANK), (ORDER[0], PRE)]
        assert r.forwarder.stats == RouterStats(
            rank_routes=Counter({RankRoute.HASH: 1}),
            forwarded=Counter(
                {(RANK, Status.INVALID_ARGUMENT): 1, (PRE, Status.DEADLINE_EXCEEDED): 1}
            ),
            versions=Counter({(RANK, MV): 1, (PRE, MV): 1}),
        )

    run(scenario)


def test_with_no_live_ranker_both_methods_are_unavailable() -> None:
    async def scenario() -> None:
        r = await rig(names=())
        assert r.forwarder.route(PRE, USER) == Refused(UNAVAILABLE, NO_RANKER)
        route = r.forwarder.route(RANK, USER)
        assert isinstance(route, Route) and route.order == ()
        assert await r.forwarder.forward(route, REQUEST) == Refused(UNAVAILABLE, NO_RANKER)
        assert r.rankers.calls == []

    run(scenario)


def test_each_attempt_gets_the_time_remaining_when_it_starts() -> None:
    async def scenario() -> None:
        r = await rig()
        for name in ORDER[:2]:
            r.rankers.behaviour[name] = CallFailed(UNAVAILABLE, "down")
        remaining = iter([3.0, 2.5, 1.75])
        await r.forwarder.serve(PRE, USER, REQUEST, lambda: next(remaining))
        assert [timeout for *_, timeout in r.rankers.calls] == [3.0, 2.5, 1.75]

    run(scenario)


def test_a_directory_write_lost_to_an_unreachable_store_is_counted_and_serving_goes_on() -> None:
    class Unreachable(MemoryCluster):
        async def record(self, placement: PlacementRecord, holder_instance_id: str) -> bool:
            raise Unavailable("etcd unreachable")

    async def scenario() -> None:
        r = await rig(cluster=Unreachable())
        r.rankers.behaviour[ORDER[0]] = CallFailed(UNAVAILABLE, "down")
        outcome = await r.forwarder.serve(PRE, USER, REQUEST)
        assert isinstance(outcome, Served) and outcome.instance == ORDER[1]
        stats = r.forwarder.stats
        assert (stats.directory_writes, stats.directory_write_failures) == (0, 1)

    run(scenario)


def test_random_placement_ignores_affinity_and_books_no_load() -> None:
    async def scenario() -> None:
        settings = ForwardSettings(0.25, 16.0, WINDOW_S, random_placement=True)
        r = await rig(settings, draw=lambda n: n - 1)  # always the last: r2, r1, r0
        route = r.forwarder.route(PRE, USER)
        assert isinstance(route, Route)
        assert (route.order, route.reason) == (("r2", "r1", "r0"), None)
        for name in ("r2", "r1"):
            r.rankers.behaviour[name] = CallFailed(UNAVAILABLE, "down")
        outcome = await r.forwarder.serve(RANK, USER, REQUEST)
        assert outcome == Served(reply("r0", RANK), "r0", attempts=3, fallback=True)
        assert r.forwarder.stats == RouterStats(
            placed_random=Counter({RANK: 1}),
            failed_over=Counter({RANK: 1}),
            forwarded=Counter({(RANK, UNAVAILABLE): 2, (RANK, OK): 1}),
            versions=Counter({(PRE, MV): 1, (RANK, MV): 1}),
        )
        assert not r.forwarder.load.loads() and r.cluster.entry(USER, MV) is None

    run(scenario)


# -- hedging --------------------------------------------------------------------------------

HEDGED = ForwardSettings(0.25, 16.0, WINDOW_S, rank_hedge_s=HEDGE_S)


def test_a_frozen_rankers_rank_is_answered_by_the_hedge_and_the_frozen_call_cancelled() -> None:
    async def scenario() -> None:
        r = await rig(HEDGED)
        r.rankers.behaviour[ORDER[0]] = FROZEN
        outcome = await r.forwarder.serve(RANK, USER, REQUEST, lambda: 20.0)
        assert outcome == Served(reply(ORDER[1], RANK), ORDER[1], attempts=2, fallback=True)
        assert r.rankers.calls == [(ORDER[0], RANK, REQUEST, 20.0), (ORDER[1], RANK, REQUEST, 20.0)]
        await eventually(lambda: r.rankers.cancelled == [ORDER[0]], "the frozen call cancelled")
        assert r.forwarder.stats == RouterStats(
            rank_routes=Counter({RankRoute.HASH: 1}),
            hedged=Counter({RANK: 1}),
            failed_over=Counter({RANK: 1}),
            forwarded=Counter({(RANK, OK): 1}),  # the cancelled call had no answer
            versions=Counter({(RANK, MV): 1}),
        )

    run(scenario)


def test_a_prompt_rank_is_not_hedged_and_pre_infers_never_are() -> None:
    async def scenario() -> None:
        r = await rig(HEDGED)
        ranked = await r.forwarder.serve(RANK, USER, REQUEST)
        assert ranked == Served(reply(ORDER[0], RANK), ORDER[0], attempts=1, fallback=False)
        # A frozen owner stalls a PreInfer (its caller's deadline bounds it): no hedge.
        r.rankers.behaviour[ORDER[0]] = FROZEN
        pre_infer = asyncio.ensure_future(r.forwarder.serve(PRE, USER, REQUEST))
        await eventually(lambda: len(r.rankers.calls) == 2, "the PreInfer reached its owner")
        done, _ = await asyncio.wait([pre_infer], timeout=4 * HEDGE_S)
        assert not done and r.rankers.called() == [(ORDER[0], RANK), (ORDER[0], PRE)]
        pre_infer.cancel()
        await eventually(lambda: r.rankers.cancelled == [ORDER[0]], "the PreInfer cancelled")
        assert r.forwarder.stats.hedged == Counter()

    run(scenario)


def test_a_hedged_rank_moves_on_at_once_when_the_first_ranker_fails_fast() -> None:
    async def scenario() -> None:
        r = await rig(HEDGED)
        r.rankers.behaviour[ORDER[0]] = CallFailed(UNAVAILABLE, "down")
        outcome = await r.forwarder.serve(RANK, USER, REQUEST)
        assert outcome == Served(reply(ORDER[1], RANK), ORDER[1], attempts=2, fallback=True)
        assert r.forwarder.stats.hedged == Counter()  # a retry, not a hedge
        assert r.forwarder.stats.forwarded == Counter({(RANK, UNAVAILABLE): 1, (RANK, OK): 1})

    run(scenario)


def test_a_hedge_answered_with_the_callers_error_cancels_the_frozen_call() -> None:
    async def scenario() -> None:
        r = await rig(HEDGED)
        r.rankers.behaviour[ORDER[0]] = FROZEN
        r.rankers.behaviour[ORDER[1]] = CallFailed(Status.INVALID_ARGUMENT, "bad candidates")
        outcome = await r.forwarder.serve(RANK, USER, REQUEST)
        assert outcome == Refused(Status.INVALID_ARGUMENT, "bad candidates")
        await eventually(lambda: r.rankers.cancelled == [ORDER[0]], "the frozen call cancelled")
        assert r.rankers.called() == [(ORDER[0], RANK), (ORDER[1], RANK)]
        assert r.forwarder.stats.hedged == Counter({RANK: 1})

    run(scenario)


def test_a_hedged_rank_every_ranker_refuses_lists_each_answer() -> None:
    async def scenario() -> None:
        r = await rig(HEDGED)
        for name in NAMES:
            r.rankers.behaviour[name] = CallFailed(EXHAUSTED, "full")
        outcome = await r.forwarder.serve(RANK, USER, REQUEST)
        expected = "no ranker could serve Rank: " + "; ".join(
            f"{name}: RESOURCE_EXHAUSTED full" for name in ORDER
        )
        assert outcome == Refused(EXHAUSTED, expected)
        assert r.forwarder.stats.hedged == Counter()

    run(scenario)
