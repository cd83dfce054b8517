"""How a dispatched relay is settled (`AdmissionPolicy.settle`, `dropped`, `preferred`): the one
place the trigger service and the simulator book a relay's end."""

from relaygr.cluster import RankerRecord
from services.trigger.config import Mode, TriggerConfig
from services.trigger.policy import AdmissionPolicy, Decision, Event, Reason, Settled

NOW = 100.0


def ranker(name: str) -> RankerRecord:
    return RankerRecord(name, f"{name}:1", "mv", 10**9, 10**9, 1024, 1.0, 0.01, 0.0, 0.0, 0.1)


def policy(mode: Mode) -> AdmissionPolicy:
    return AdmissionPolicy(TriggerConfig(plaintext=True, mode=mode, slo_ms=1.0, margin_ms=0.0))


def alice() -> Event:
    return Event("alice", 4096, 16, 64, lambda: "digest-a", "mv")


def admitted(p: AdmissionPolicy) -> Decision:
    decision = p.decide(alice(), [ranker("r0"), ranker("r1")], NOW)
    assert decision.admitted, decision
    return decision


def test_sequence_aware_asks_for_its_target_and_all_for_nothing() -> None:
    aware = policy(Mode.SEQUENCE_AWARE)
    assert aware.preferred(admitted(aware)) == "r0"
    everything = policy(Mode.ALL)
    assert everything.preferred(admitted(everything)) == ""


def test_a_relay_that_landed_where_asked_is_relayed_and_booked_cached() -> None:
    p = policy(Mode.SEQUENCE_AWARE)
    d = admitted(p)
    assert p.settle(d, "alice", "r0", ("r0", 4096), False, NOW + 0.1) is Settled.RELAYED
    again = p.decide(alice(), [ranker("r0")], NOW)
    assert again.reason is Reason.ALREADY_CACHED


def test_one_that_landed_elsewhere_marks_the_asked_ranker_full() -> None:
    p = policy(Mode.SEQUENCE_AWARE)
    d = admitted(p)
    settled = p.settle(d, "alice", "r0", ("r1", 4096), False, NOW + 0.1)
    assert settled is Settled.RELAYED_ELSEWHERE
    assert not p.room.fits(ranker("r0"), 1, NOW + 0.2)


def test_refused_for_room_and_failed_free_the_booking() -> None:
    for refused, expected in ((True, Settled.REFUSED), (False, Settled.FAILED)):
        p = policy(Mode.SEQUENCE_AWARE)
        d = admitted(p)
        assert p.settle(d, "alice", "r0", None, refused, NOW + 0.1) is expected
        assert p.room.fits(ranker("r0"), 1, NOW + 0.2) is not refused
        # the relay is no longer in flight: the same prefix may be admitted again
        again = p.decide(
            Event("alice", 4096, 16, 64, lambda: "digest-a", "mv"), [ranker("r1")], NOW
        )
        assert again.reason is not Reason.IN_FLIGHT


def test_a_dropped_relay_is_told_load_limit_and_freed() -> None:
    p = policy(Mode.ALL)
    d = admitted(p)
    told = p.dropped(d, "alice")
    assert told.reason is Reason.LOAD_LIMIT and told.model_version == "mv" and not told.admitted
    again = p.decide(alice(), [ranker("r0")], NOW)
    assert again.admitted
