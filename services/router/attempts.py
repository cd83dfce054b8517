"""One forwarded request's calls down its route: which ranker to call next, when to hedge, and how
it ends. Synchronous: the router service's asyncio driver and the simulator's virtual clock both
feed it answers and timer expiries and do what it returns (docs/architecture.md, "Cores and
drivers")."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.router.routes import (
    NO_RANKER,
    CallFailed,
    Method,
    Refused,
    Route,
    Served,
    Status,
)


@dataclass(frozen=True, slots=True)
class Call:
    """Call `instance` now (its `attempt`-th call, counting from 1)."""

    instance: str
    attempt: int


# What an event leads to: calls to start now (none: wait for the calls in flight), or the end.
Next = list[Call] | Served | Refused


@dataclass(slots=True)
class Attempts:
    """The calls of one request down `route.order`, one at a time, with at most one hedge.

    Invariants: a ranker is called at most once; calls start in route order; the request ends
    at the first reply (`Served`), at the first status outside `TRY_NEXT` (that status, as
    the caller's answer), or when every ranker failed with a status in `TRY_NEXT`
    (`refusal`). With `hedge_s` (an affinity-routed Rank only), a call unanswered that long is
    joined by a call to the next ranker, once per request: the driver (re)arms a timer of
    `hedge_s` whenever `hedge_armed` is true after an event, and calls `hedge` when it fires.
    What happens to a call still running at the end (cancelled, or its answer ignored) is the
    driver's.
    """

    route: Route
    hedge_s: float | None
    # Counting and learning, done by the forwarder (`Forwarder.answered`, `Forwarder.failed`).
    on_answer: Callable[[Route, bytes, str, int, Sequence[tuple[str, CallFailed]]], Served]
    on_failure: Callable[[Route, str, CallFailed], Refused | None]
    on_hedge: Callable[[Method], None]
    failures: list[tuple[str, CallFailed]] = field(default_factory=list)
    started: int = 0  # calls started (the next one calls route.order[started])
    in_flight: set[str] = field(default_factory=set)
    hedged: bool = False
    ended: bool = False

    def start(self) -> Next:
        """The first call; an empty route is refused at once."""
        if not self.route.order:
            return self._end(Refused(Status.UNAVAILABLE, NO_RANKER))
        return [self._call()]

    @property
    def hedge_armed(self) -> bool:
        """Whether a hedge timer should run now: the request can still hedge and has a ranker
        left to hedge to, with a call in flight."""
        return (
            self.hedge_s is not None
            and not self.hedged
            and not self.ended
            and bool(self.in_flight)
            and self.started < len(self.route.order)
        )

    def hedge(self) -> Next:
        """The hedge timer fired: call the next ranker too (nothing if it may no longer)."""
        if not self.hedge_armed:
            return []
        self.hedged = True
        self.on_hedge(self.route.method)
        return [self._call()]

    def answered(self, instance: str, answer: bytes | CallFailed) -> Next:
        """`instance` answered: a reply ends the request; a failure moves on or ends it. After
        the end, an answer changes nothing (a losing hedge's)."""
        if self.ended or instance not in self.in_flight:
            return []
        self.in_flight.discard(instance)
        if not isinstance(answer, CallFailed):
            served = self.on_answer(self.route, answer, instance, self.started, self.failures)
            return self._end(served)
        refused = self.on_failure(self.route, instance, answer)
        if refused is not None:
            return self._end(refused)
        self.failures.append((instance, answer))
        if self.in_flight:
            return []  # the hedge's partner is still running
        if self.started < len(self.route.order):
            return [self._call()]
        return self._end(refusal(self.route.method, self.failures))

    def _call(self) -> Call:
        instance = self.route.order[self.started]
        self.started += 1
        self.in_flight.add(instance)
        return Call(instance, self.started)

    def _end(self, outcome: Served | Refused) -> Served | Refused:
        self.ended = True
        return outcome


def refusal(method: Method, failures: Sequence[tuple[str, CallFailed]]) -> Refused:
    """The answer when every ranker tried failed with a status in `TRY_NEXT`: RESOURCE_EXHAUSTED
    if every one refused for want of room, else UNAVAILABLE; the message lists each answer."""
    message = f"no ranker could serve {method}: " + "; ".join(
        f"{instance}: {failed.status} {failed.details}" for instance, failed in failures
    )
    if {failed.status for _, failed in failures} == {Status.RESOURCE_EXHAUSTED}:
        return Refused(Status.RESOURCE_EXHAUSTED, message)
    return Refused(Status.UNAVAILABLE, message)
