"""Timed relays (`earliest_gap_ms`): a PreInfer sent so that its prefill ends when the earliest
Ranks come, and the room judged as it will be then (`RelayRoom.held`, `in_flight` at a time)."""

import asyncio
import time
from collections.abc import Callable

import pytest

from relaygr.errors import ConfigError
from relaygr.room import Relay, RelayRoom, RoomReport
from relaygr.v1 import common_pb2, trigger_pb2
from services.trigger.config import Mode
from services.trigger.dispatch import Dispatcher, Failure, Job
from services.trigger.policy import AdmissionPolicy, Decision, Reason
from tests.unit.trigger.test_policy import NBYTES, NOW, PREFILL_MS, X, config, event, ranker

EARLIEST = 100.0  # ms: the gap few Ranks come sooner than


def test_a_timed_relay_is_sent_so_that_its_prefill_ends_at_the_earliest_gap() -> None:
    policy = AdmissionPolicy(config(earliest_gap_ms=EARLIEST))
    decided = policy.decide(event("a"), [ranker()], NOW)
    assert decided.admitted
    assert decided.send_in_ms == pytest.approx(EARLIEST - PREFILL_MS)  # 82.5 ms


def test_the_work_queued_on_the_ranker_sends_a_timed_relay_sooner() -> None:
    """Background prefill ahead of it (the no-show share of what is queued: all of it until
    relays end) and rank work queued there both run before its prefill."""
    policy = AdmissionPolicy(config(earliest_gap_ms=EARLIEST))
    policy.room.observe(X, RoomReport(0, 10**9, queued_prefill_ms=30.0, queued_rank_ms=20.0), NOW)
    assert policy.decide(event("a"), [ranker()], NOW).send_in_ms == pytest.approx(32.5)
    policy.room.observe(X, RoomReport(0, 10**9, queued_prefill_ms=90.0), NOW + 0.01)
    assert policy.decide(event("b"), [ranker()], NOW + 0.01).send_in_ms == 0.0  # no time left


@pytest.mark.parametrize("mode", [Mode.SEQUENCE_AWARE, Mode.ALL])
def test_untimed_every_relay_is_sent_at_once(mode: Mode) -> None:
    policy = AdmissionPolicy(config(mode=mode))
    assert policy.decide(event("a"), [ranker()], NOW).send_in_ms == 0.0


def test_relay_all_times_its_relays_too() -> None:
    policy = AdmissionPolicy(config(mode=Mode.ALL, earliest_gap_ms=EARLIEST))
    assert policy.decide(event("a"), [ranker()], NOW).send_in_ms == pytest.approx(82.5)


def test_the_earliest_gap_cannot_exceed_the_expected_one() -> None:
    with pytest.raises(ConfigError, match="earliest_gap_ms must be at most expected_gap_ms"):
        config(earliest_gap_ms=1001.0, expected_gap_ms=1000.0)


def test_a_relay_booked_for_later_holds_no_room_before_it_is_sent() -> None:
    room = RelayRoom(window_s=2.0)
    room.start("a", Relay(X, NBYTES, NOW + 2.1, PREFILL_MS, admitted_at=NOW + 0.1))
    assert room.in_flight(X, NOW) == 0  # not sent yet
    assert room.held(X, NOW) == 0
    assert room.in_flight(X, NOW, at=NOW + 0.1) == NBYTES  # as it will be when sent
    assert room.held(X, NOW, at=NOW + 0.2) == NBYTES
    assert room.in_flight(X, NOW + 0.1) == room.held(X, NOW + 0.1) == NBYTES  # sent
    room.settle("a", X, NBYTES, NOW + 0.12)
    assert room.in_flight(X, NOW + 0.12) == 0
    assert room.held(X, NOW + 0.12) == NBYTES  # pinned: until an observation covers it


def test_a_timed_relay_is_judged_by_the_room_at_its_send_time() -> None:
    """Room for one relay: the first, timed, holds it once sent, so a second is refused though
    nothing is in flight yet, and though the first's prefill queued ahead of it would send the
    second sooner than the first (the room is judged when a relay's prefill is due to end)."""
    policy = AdmissionPolicy(config(earliest_gap_ms=EARLIEST, relay_budget_share=0.5))
    target = ranker(hbm_budget_bytes=2 * NBYTES)  # room for one relay
    assert policy.decide(event("a"), [target], NOW).admitted  # sent at NOW + 82.5 ms
    assert policy.room.in_flight(X, NOW) == 0  # nothing sent yet
    assert policy.decide(event("b"), [target], NOW).reason is Reason.NO_ROOM


def test_relays_whose_rank_is_due_by_the_send_time_are_taken_as_consumed_then() -> None:
    room = RelayRoom(window_s=2.0)
    room.start("p", Relay(X, NBYTES, NOW + 1.0, PREFILL_MS, NOW - 1.0, due_at=NOW + 0.05))
    room.settle("p", X, NBYTES, NOW - 0.9)
    room.observe(X, RoomReport(NBYTES, 10**9), NOW - 0.5)  # pinned, its Rank still to come
    assert room.held(X, NOW, ranked=1.0) == NBYTES
    assert room.held(X, NOW, ranked=1.0, at=NOW + 0.06) == 0


# -- the dispatcher holds a timed job until its time ------------------------------------------


def _job(user: str, send_at: float | None) -> Job:
    decision = Decision(Reason.ADMITTED, 60.0, X, NBYTES, PREFILL_MS, "d")
    return Job(decision, trigger_pb2.RetrievalEvent(user_id=user), 2000, send_at=send_at)


async def _poll(check: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def test_the_dispatcher_sends_a_timed_job_at_its_time_and_not_before() -> None:
    async def scenario() -> None:
        sent: dict[str, float] = {}

        async def send(request: common_pb2.PreInferRequest, _: float) -> common_pb2.PreInferReply:
            sent[request.user_id] = time.monotonic()
            return common_pb2.PreInferReply(instance_id=X, kv_bytes=NBYTES)

        ended: list[tuple[str, Failure | None]] = []
        dispatcher = Dispatcher(send, capacity=2, concurrency=1)
        dispatcher.start(lambda job, _, failure: ended.append((job.user_id, failure)))
        at = time.monotonic() + 0.05
        assert dispatcher.submit(_job("later", at))
        assert dispatcher.submit(_job("now", None))
        assert not dispatcher.submit(_job("over", None))  # held and queued fill its capacity
        assert (dispatcher.queued(), dispatcher.pending()) == (2, 2)
        await _poll(lambda: len(ended) == 2, "both jobs sent")
        assert [user for user, _ in ended] == ["now", "later"]
        assert sent["later"] >= at
        assert dispatcher.pending() == 0
        await dispatcher.stop()

    asyncio.run(scenario())


def test_a_held_job_is_waited_for_on_drain_and_cancelled_on_stop() -> None:
    async def scenario() -> None:
        async def send(request: common_pb2.PreInferRequest, _: float) -> common_pb2.PreInferReply:
            return common_pb2.PreInferReply(instance_id=X, kv_bytes=NBYTES)

        ended: list[str] = []
        dispatcher = Dispatcher(send, capacity=4, concurrency=1)
        dispatcher.start(lambda job, *_: ended.append(job.user_id))
        assert dispatcher.submit(_job("soon", time.monotonic() + 0.02))
        assert await dispatcher.drain(5.0)
        assert ended == ["soon"]
        assert dispatcher.submit(_job("never", time.monotonic() + 60.0))
        assert not await dispatcher.drain(0.01)  # held for a minute
        await dispatcher.stop()
        assert (dispatcher.stats.cancelled, dispatcher.pending(), ended) == (1, 0, ["soon"])

    asyncio.run(scenario())
