"""The ranker core's records: an in-flight prefix (an explicit state machine) and a pending
request; both mutated by the core alone."""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.ranker.core_types import PrefixRef, RankRef, RequestId
from services.ranker.kv_store import CacheKey
from services.ranker.outcomes import CacheOutcome, Origin
from services.ranker.plan import Source
from services.ranker.queues import Job, Priority


class FlightState(StrEnum):
    """An in-flight prefix: FETCHING (from a peer; nothing queued) -> landed, or -> COMPUTING
    (the fallback: as it would have been computed without peers); COMPUTING (its job queued or
    running, `job.queued` says which) -> landed or failed."""

    FETCHING = "fetching"
    COMPUTING = "computing"


@dataclass(eq=False, slots=True)
class Flight:
    """The one computation, reload or fetch of a key; mutated by the core alone."""

    key: CacheKey
    prefix: PrefixRef
    state: FlightState
    source: Source
    computed_tokens: int  # prefix tokens it computes (0 for a reload or a fetch)
    pin_for: float | None  # a PreInfer's relay window: it lands pinned (None: a Rank's)
    due: float | None
    # What the landed entry records as its origin: the requester, except that a Rank's reload
    # of a host copy keeps the copy's producer (the content is the same).
    origin: Origin | None
    job: Job | None = None  # None while FETCHING
    taken_over: bool = False  # a Rank restarted this PreInfer's job as its own computation
    # A fetch's fallback: computed at this priority, by this deadline, should the fetch fail.
    fallback_priority: Priority = Priority.BACKGROUND
    fallback_deadline: float | None = None
    waiters: list[RequestId] = field(default_factory=list)
    tag: Any = None  # the starting request's
    # The Rank its job scores as it computes the prefix (a miss computed in one call, a
    # `FullForward` that keeps the prefix): answered from the job's scores when it lands.
    scores_for: RequestId | None = None
    # Device bytes reserved for it by the PreInfer that started it (0: a Rank's, or joined).
    reserved_bytes: int = 0

    @property
    def relay(self) -> bool:
        return self.pin_for is not None


class Role(StrEnum):
    STARTED = "started"  # a PreInfer that started the flight
    JOINED = "joined"  # a PreInfer that found it in flight
    WAITING = "waiting"  # a Rank waiting for another request's flight
    OWN = "own"  # a Rank whose own computation the flight is
    SCORING = "scoring"  # a Rank whose scoring job runs


@dataclass(eq=False, slots=True)
class Pending:
    rid: RequestId
    role: Role
    key: CacheKey | None
    prefix: PrefixRef
    deadline: float | None
    window_s: float = 0.0  # a PreInfer's relay window
    rank: RankRef | None = None
    outcome: CacheOutcome = CacheOutcome.HBM_HIT
    computed: int = 0
    relayed: bool = False
    own: Origin | None = None
    consumed: Origin | None = None
    job: Job | None = None  # its scoring job
    tag: Any = None
    arrived: float = 0.0  # when it arrived (a Rank's place in the rank line)
