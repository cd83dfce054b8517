"""The forwarder with a relay room view: a PreInfer goes to its preferred ranker, skips rankers
the view says are full, and the view learns from refusals; in-memory cluster, fake calls."""

from collections import Counter

from relaygr.cluster import PlacementRecord
from relaygr.placement import Reason
from relaygr.room import RelayRoom, RoomReport
from services.router.forward import Forwarder, RelayHint, RouterStats
from services.router.routes import CallFailed, Route, Served
from tests.unit.router.test_forward import (
    EXHAUSTED,
    MV,
    OK,
    ORDER,
    PRE,
    RANK,
    REQUEST,
    SETTINGS,
    USER,
    WINDOW_S,
    Rig,
    reply,
    rig,
    run,
)

BUDGET = 2**30  # every ranker's device tier (test_forward.record)
TOKENS = 1000
NBYTES = TOKENS * 1024
HINT = RelayHint(tokens=TOKENS)
FULL = RoomReport(BUDGET - NBYTES + 1, BUDGET)  # one byte short of room for the relay
ROOMY = RoomReport(0, BUDGET)


async def room_rig() -> tuple[Rig, RelayRoom]:
    r = await rig()
    room = RelayRoom(WINDOW_S, refusal_s=1.0)
    forwarder = Forwarder(SETTINGS, r.cluster, r.cluster, r.rankers.connect, r.clock, room=room)
    return Rig(r.cluster, r.rankers, r.clock, forwarder), room


def test_a_live_preferred_ranker_is_tried_first_and_the_directory_learns_it() -> None:
    async def scenario() -> None:
        r, _ = await room_rig()
        hint = RelayHint(ORDER[2], TOKENS)
        route = r.forwarder.route(PRE, USER, hint)
        assert isinstance(route, Route)
        assert route.order == (ORDER[2], ORDER[0], ORDER[1])
        assert route.reason is Reason.PREFERRED
        outcome = await r.forwarder.serve(PRE, USER, REQUEST, hint=hint)
        assert outcome == Served(reply(ORDER[2], PRE), ORDER[2], attempts=1, fallback=False)
        assert r.rankers.called() == [(ORDER[2], PRE)]
        assert r.forwarder.stats == RouterStats(
            placed=Counter({Reason.PREFERRED: 1}),
            forwarded=Counter({(PRE, OK): 1}),
            directory_writes=1,
            versions=Counter({(PRE, MV): 2}),
        )
        placed = PlacementRecord(USER, ORDER[2], r.clock.now + WINDOW_S, MV)
        assert r.cluster.entry(USER, MV) == placed
        ranked = await r.forwarder.serve(RANK, USER, REQUEST)  # the Rank follows it there
        assert isinstance(ranked, Served) and ranked.instance == ORDER[2]

    run(scenario)


def test_a_preferred_ranker_not_live_is_ignored() -> None:
    async def scenario() -> None:
        r, _ = await room_rig()
        route = r.forwarder.route(PRE, USER, RelayHint("gone", TOKENS))
        assert isinstance(route, Route)
        assert (route.order, route.reason) == (ORDER, Reason.HASH)

    run(scenario)


def test_without_a_preference_rankers_the_view_says_are_full_are_tried_last() -> None:
    async def scenario() -> None:
        r, room = await room_rig()
        room.observe(ORDER[0], FULL, r.clock.now)
        room.observe(ORDER[1], ROOMY, r.clock.now)
        small = r.forwarder.route(PRE, USER, RelayHint(tokens=1))  # a smaller relay fits
        assert isinstance(small, Route) and small.order == ORDER
        outcome = await r.forwarder.serve(PRE, USER, REQUEST, hint=HINT)
        assert outcome == Served(reply(ORDER[1], PRE), ORDER[1], attempts=1, fallback=False)
        assert r.rankers.called() == [(ORDER[1], PRE)]  # no refusal collected on the way
        assert r.forwarder.stats.placed == Counter({Reason.ROOM: 1})
        assert r.forwarder.stats.refused_then_spilled == 0
        assert room.held(ORDER[1], r.clock.now) == NBYTES  # booked until observed

    run(scenario)


def test_when_every_ranker_is_full_the_order_is_kept_and_rankers_have_the_final_word() -> None:
    async def scenario() -> None:
        r, room = await room_rig()
        for name in ORDER:
            room.observe(name, FULL, r.clock.now)
        route = r.forwarder.route(PRE, USER, HINT)
        assert isinstance(route, Route) and (route.order, route.reason) == (ORDER, Reason.HASH)
        outcome = await r.forwarder.serve(PRE, USER, REQUEST, hint=HINT)  # the view was stale
        assert outcome == Served(reply(ORDER[0], PRE), ORDER[0], attempts=1, fallback=False)

    run(scenario)


def test_a_refusal_marks_the_ranker_full_and_the_round_trip_is_counted() -> None:
    async def scenario() -> None:
        r, room = await room_rig()
        r.rankers.behaviour[ORDER[0]] = CallFailed(EXHAUSTED, "no room")
        outcome = await r.forwarder.serve(PRE, USER, REQUEST, hint=HINT)
        assert outcome == Served(reply(ORDER[1], PRE), ORDER[1], attempts=2, fallback=True)
        assert r.forwarder.stats.refused_then_spilled == 1
        assert room.refused(ORDER[0], r.clock.now)
        # The next relay goes straight to where there is room: no second round trip.
        r.rankers.calls.clear()
        again = await r.forwarder.serve(PRE, "alice", REQUEST + b"2", hint=RelayHint(tokens=5))
        assert isinstance(again, Served) and again.attempts == 1
        assert r.rankers.called() == [(ORDER[1], PRE)]
        assert r.forwarder.stats.refused_then_spilled == 1
        # An observation sent after the refusal clears it; so does the cooldown.
        room.observe(ORDER[0], ROOMY, r.clock.now + 0.1)
        assert not room.refused(ORDER[0], r.clock.now + 0.2)
        route = r.forwarder.route(PRE, USER, HINT)  # the directory now sends alice to ORDER[1]
        assert isinstance(route, Route) and route.order == (ORDER[1], ORDER[0], ORDER[2])

    run(scenario)


def test_a_refused_rank_teaches_nothing_about_relay_room() -> None:
    async def scenario() -> None:
        r, room = await room_rig()
        r.rankers.behaviour[ORDER[0]] = CallFailed(EXHAUSTED, "too many RPCs")
        outcome = await r.forwarder.serve(RANK, USER, REQUEST)
        assert isinstance(outcome, Served) and outcome.instance == ORDER[1]
        assert not room.refused(ORDER[0], r.clock.now)
        assert r.forwarder.stats.refused_then_spilled == 0

    run(scenario)
