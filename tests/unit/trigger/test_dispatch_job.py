"""An admitted relay's PreInfer: where the trigger found room and when its Rank is due."""

from relaygr.v1 import trigger_pb2
from services.trigger.dispatch import Job
from services.trigger.policy import Decision, Reason

EVENT = trigger_pb2.RetrievalEvent(request_id="q", user_id="u", request_ts=7)
DECISION = Decision(Reason.ADMITTED, 60.0, "r1", 1000, 17.5, "d", relay_window_ms=300)


def test_the_pre_infer_names_the_ranker_with_room_and_the_rest_of_the_gap() -> None:
    job = Job(DECISION, EVENT, 2000, None, preferred_instance="r1", rank_due_at=10.25)
    request = job.pre_infer(10.0)  # 250 ms of the gap left when it is sent
    assert (request.preferred_instance, request.rank_expected_in_ms) == ("r1", 250)
    # The window its decision asked for, not the timeout (the longest window).
    assert (request.user_id, request.relay_window_ms, request.request_ts) == ("u", 300, 7)
    assert job.pre_infer(10.3).rank_expected_in_ms == 1  # overdue: due now, never "no estimate"


def test_without_an_expectation_the_pre_infer_leaves_both_fields_unset() -> None:
    request = Job(DECISION, EVENT, 2000).pre_infer(10.0)
    assert (request.preferred_instance, request.rank_expected_in_ms) == ("", 0)
