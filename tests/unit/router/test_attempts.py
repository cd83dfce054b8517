"""The router's attempts core (`services.router.attempts`): events in, calls out, on plain data,
with no event loop; one per way a request can go."""

from collections import Counter
from collections.abc import Sequence

from relaygr.placement import Reason
from services.router.attempts import Attempts, Call
from services.router.routes import TRY_NEXT, CallFailed, Method, Refused, Route, Served, Status

ORDER = ("r0", "r1", "r2")
DOWN = CallFailed(Status.UNAVAILABLE, "down")
FULL = CallFailed(Status.RESOURCE_EXHAUSTED, "full")
BAD = CallFailed(Status.INVALID_ARGUMENT, "bad request")


class Books:
    """What the forwarder is told: answers, failures and hedges, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.hedged: Counter[Method] = Counter()

    def answered(
        self,
        route: Route,
        reply: bytes,
        instance: str,
        attempts: int,
        failures: Sequence[tuple[str, CallFailed]],
    ) -> Served:
        self.log.append(("answered", instance))
        return Served(reply, instance, attempts, instance != route.order[0])

    def failed(self, route: Route, instance: str, failed: CallFailed) -> Refused | None:
        self.log.append(("failed", instance))
        ends = failed.status not in TRY_NEXT
        return Refused(failed.status, failed.details or "") if ends else None

    def hedge(self, method: Method) -> None:
        self.hedged[method] += 1


def attempts(
    method: Method = Method.RANK, hedge_s: float | None = None, order: tuple[str, ...] = ORDER
) -> tuple[Attempts, Books]:
    books = Books()
    route = Route(method, "alice", order, {}, Reason.HASH)
    return Attempts(route, hedge_s, books.answered, books.failed, books.hedge), books


def test_the_first_reply_ends_the_request_after_one_call() -> None:
    a, books = attempts()
    assert a.start() == [Call("r0", 1)]
    assert a.answered("r0", b"scores") == Served(b"scores", "r0", 1, False)
    assert books.log == [("answered", "r0")]
    assert not a.hedge_armed


def test_a_ranker_that_cannot_serve_passes_the_request_down_the_order() -> None:
    a, _ = attempts()
    a.start()
    assert a.answered("r0", DOWN) == [Call("r1", 2)]
    assert a.answered("r1", FULL) == [Call("r2", 3)]
    assert a.answered("r2", b"ok") == Served(b"ok", "r2", 3, True)


def test_a_status_outside_try_next_is_the_answer_at_once() -> None:
    a, books = attempts()
    a.start()
    assert a.answered("r0", BAD) == Refused(Status.INVALID_ARGUMENT, "bad request")
    assert a.ended and books.log == [("failed", "r0")]


def test_every_ranker_full_is_resource_exhausted_and_any_down_is_unavailable() -> None:
    a, _ = attempts(Method.PRE_INFER)
    a.start()
    a.answered("r0", FULL)
    a.answered("r1", FULL)
    full = a.answered("r2", FULL)
    assert isinstance(full, Refused) and full.status is Status.RESOURCE_EXHAUSTED
    assert "r0: RESOURCE_EXHAUSTED full" in full.message
    b, _ = attempts(Method.PRE_INFER)
    b.start()
    b.answered("r0", FULL)
    b.answered("r1", DOWN)
    mixed = b.answered("r2", FULL)
    assert isinstance(mixed, Refused) and mixed.status is Status.UNAVAILABLE


def test_an_empty_route_is_unavailable() -> None:
    a, _ = attempts(order=())
    end = a.start()
    assert isinstance(end, Refused) and end.status is Status.UNAVAILABLE


def test_a_hedge_calls_the_next_ranker_once_and_the_first_reply_wins() -> None:
    a, books = attempts(hedge_s=0.05)
    a.start()
    assert a.hedge_armed
    assert a.hedge() == [Call("r1", 2)]
    assert books.hedged[Method.RANK] == 1
    assert not a.hedge_armed and a.hedge() == []  # once per request
    assert a.answered("r1", b"late owner lost") == Served(b"late owner lost", "r1", 2, True)
    assert a.answered("r0", b"too late") == []  # a losing call's answer changes nothing
    assert books.log == [("answered", "r1")]


def test_a_hedged_pair_waits_for_the_partner_when_one_fails() -> None:
    a, _ = attempts(hedge_s=0.05)
    a.start()
    a.hedge()
    assert a.answered("r0", DOWN) == []  # r1 is still running
    assert a.answered("r1", DOWN) == [Call("r2", 3)]
    assert not a.hedge_armed  # hedged already


def test_a_fast_failure_before_the_hedge_moves_on_and_rearms_it() -> None:
    a, _ = attempts(hedge_s=0.05)
    a.start()
    assert a.answered("r0", DOWN) == [Call("r1", 2)]
    assert a.hedge_armed  # the new call may still be hedged, to r2
    assert a.hedge() == [Call("r2", 3)]


def test_the_last_ranker_is_never_hedged() -> None:
    a, _ = attempts(hedge_s=0.05, order=("r0",))
    a.start()
    assert not a.hedge_armed and a.hedge() == []
