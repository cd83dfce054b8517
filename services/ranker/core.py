"""The ranker's decisions, synchronous: PreInfer builds and pins a prefix cache, Rank consumes it.

Events in (a request arrived, a step or a fetch ended, the worker is free, drain began, a tick),
actions out (`core_types`: run this step, start this fetch, stop waiting, answer). No I/O, no
clock read: the service (services/ranker/engine.py) and the simulator (relaygr/sim/ranker.py)
drive this one copy.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, Protocol

from relaygr.cost import CostModel
from relaygr.errors import DeadlineExceeded, InvalidInput, ResourceExhausted, Unavailable
from services.ranker.core_types import (
    KV,
    Action,
    Answer,
    Computed,
    CoreSettings,
    CoreStats,
    Extend,
    FullForward,
    JobEnd,
    JobEnded,
    Observation,
    Prefill,
    PrefixRef,
    PreInferAnswer,
    PreInferServed,
    RankAnswer,
    RankRef,
    RankServed,
    Reload,
    RequestId,
    RunStep,
    Score,
    Spec,
    StartFetch,
    Waited,
    history_tokens,
    work_of,
)
from services.ranker.digest import ModelVersion
from services.ranker.handoff_order import Candidate, Declined, admit_received, value_order
from services.ranker.kv_store import CacheKey, Entry, KVStore, Tier
from services.ranker.outcomes import CacheOutcome, Origin, PreInferOutcome, Work
from services.ranker.plan import PRE_INFER_OUTCOME, RANK_OUTCOME, Held, Source, cheapest, sooner
from services.ranker.queues import ComputeQueues, Job, Overloaded, Priority

_WORK = {Source.RELOAD: Work.RELOAD, Source.EXTEND: Work.EXTEND, Source.PREFILL: Work.PREFILL}


class PeerPlanner(Protocol):
    """Whom a missing prefix may be fetched from, and the predicted transfer time (no I/O)."""

    def peers(self, key: CacheKey) -> list[Any]: ...

    def transfer_ms(self, nbytes: int) -> float: ...


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

    @property
    def relay(self) -> bool:
        return self.pin_for is not None


class _Role(StrEnum):
    STARTED = "started"  # a PreInfer that started the flight
    JOINED = "joined"  # a PreInfer that found it in flight
    WAITING = "waiting"  # a Rank waiting for another request's flight
    OWN = "own"  # a Rank whose own computation the flight is
    SCORING = "scoring"  # a Rank whose scoring job runs


@dataclass(eq=False, slots=True)
class _Request:
    rid: RequestId
    role: _Role
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


Observer = Callable[[Observation], None]


class RankerCore(Generic[KV]):
    """One ranker's request flow over one KV store and one set of compute queues.

    Per cache key at most one computation, reload or fetch is in flight (single flight): a
    PreInfer or Rank that finds one joins it. Background prefill is ordered by when its Rank is
    expected. A Rank that finds background work for its prefix either waits for it, promoting it
    to rank priority, or restarts it as its own one-call computation, whichever the cost model
    predicts finishes first. A finished prefix is stored before it leaves the in-flight table,
    so no request ever sees neither. A miss is served by full inference, computed as prefill +
    rank (the same work), which leaves the prefix cached for return visits. With `peers`, a
    missing prefix a peer may hold is fetched when that is predicted sooner than every local
    way; when no peer delivers it, the same flight computes it, so a fetch never fails a request.

    The driver runs one step at a time: it asks `worker_free` for the next when its worker is
    idle. Observations go to `observe`, in the order they happen; nothing it does changes a
    decision.
    """

    def __init__(
        self,
        store: KVStore[KV],
        cost_model: CostModel,
        settings: CoreSettings,
        model_version: ModelVersion,
        kv_bytes_per_token: int,
        held_of: Callable[[KV], Held],
        clock: Callable[[], float],
        observe: Observer | None = None,
        peers: PeerPlanner | None = None,
        wall_ns: Callable[[], int] = lambda: 0,
        record: Callable[[Action], None] | None = None,
    ) -> None:
        """`kv_bytes_per_token`: what a prefix token holds; `held_of`: a cached prefix's sizes
        and whether it is on the device; `wall_ns`: the wall clock, for tracing times only;
        `record`: sees every action, in order (a log that tests compare across drivers)."""
        self.store = store
        self.cost_model = cost_model
        self.settings = settings
        self.model_version = model_version
        self._bytes_per_token = kv_bytes_per_token
        self.queues = ComputeQueues(settings.max_queued(), clock)
        self.clock = clock
        self._held_of = held_of
        self._observe = observe or (lambda _: None)
        self._peers = peers
        self._wall_ns = wall_ns
        self.flights: dict[CacheKey, Flight] = {}
        self._requests: dict[RequestId, _Request] = {}
        self._owner: dict[Job, CacheKey | RequestId] = {}  # a job's flight key or Rank
        self._next_id = 0
        self._running: Job | None = None
        self.draining = False
        self._actions: list[Action] = []
        self._record = record

    # -- queries ---------------------------------------------------------------------------

    def inflight(self) -> int:
        """Prefix computations, reloads and fetches in flight."""
        return len(self.flights)

    def computing(self, key: CacheKey) -> bool:
        return key in self.flights

    def waiting(self, rid: RequestId) -> bool:
        """Whether request `rid` waits for another request's in-flight prefix now."""
        request = self._requests.get(rid)
        return request is not None and request.role in (_Role.JOINED, _Role.WAITING)

    def queued(self) -> int:
        """Jobs queued or running."""
        running = 0 if self._running is None else 1
        return running + sum(self.queues.depth(p) for p in Priority)

    def stats(self) -> CoreStats:
        """A snapshot for the metrics and Describe (reading changes nothing)."""
        return CoreStats(
            {tier: self.store.usage(tier) for tier in Tier},
            self.store.stats,
            {p: self.queues.depth(p) for p in Priority},
            self.queues.queued_background_ms(),
            len(self.flights),
            self.cost_model,
        )

    def key(self, prefix: PrefixRef) -> CacheKey:
        return CacheKey(prefix.user_id, self.model_version, prefix.digest)

    def fetch_deadline(self, key: CacheKey) -> float | None:
        """The deadline a running fetch's fallback must meet (None: none)."""
        flight = self.flights.get(key)
        return None if flight is None else flight.fallback_deadline

    def held_for_peer(self, key: CacheKey) -> Entry[KV] | None:
        """The entry held under exactly `key` (HBM first, else its host copy), for a peer that
        missed it or a hand-off; a peek: its LRU place, pin and tier stay."""
        return self.store.peek_any(key)

    def use_mark(self) -> int:
        """The store's use count now: `receive` displaces only entries idle since a mark."""
        return self.store.use_mark()

    def receive(
        self, key: CacheKey, kv: KV, origin: Origin | None, idle_before: int
    ) -> Tier | Declined:
        """A prefix handed off by a draining peer: stored unpinned, or why not
        (`handoff_order.admit_received`)."""
        return admit_received(self.store, key, kv, origin, idle_before, self.computing)

    def handoff_order(self) -> list[Candidate]:
        """Every held prefix, most valuable first (`handoff.value_order`), for a drain."""
        self.store.expire()
        return value_order(
            Candidate(e.key, tier, e.nbytes, e.pinned_until, e.last_use)
            for tier in Tier
            for e in self.store.entries(tier)
        )

    # -- events: requests ------------------------------------------------------------------

    def pre_infer(
        self,
        prefix: PrefixRef,
        relay_window_s: float | None,
        deadline: float | None,
        rank_expected_in_s: float | None = None,
        origin: Origin | None = None,
        tag: Any = None,
    ) -> tuple[RequestId, list[Action]]:
        """A PreInfer arrived; `rank_expected_in_s`: when its Rank is expected, from now (None:
        the end of the relay window); `tag`: the driver's, carried by the jobs it causes."""
        rid = self._new_id()
        request = _Request(rid, _Role.STARTED, None, prefix, deadline, tag=tag)
        try:
            self._pre_infer(request, relay_window_s, rank_expected_in_s, origin)
        except (Unavailable, InvalidInput, ResourceExhausted) as err:
            self._answer(rid, error=err)
        return rid, self._flush()

    def rank(
        self,
        request: RankRef,
        deadline: float | None,
        origin: Origin | None = None,
        tag: Any = None,
    ) -> tuple[RequestId, list[Action]]:
        """A Rank arrived; `origin`: the request as the producer of what it computes."""
        rid = self._new_id()
        r = _Request(rid, _Role.SCORING, None, request.prefix, deadline, rank=request, own=origin,
                     tag=tag)  # fmt: skip
        self._requests[rid] = r
        try:
            self._rank(r)
        except ResourceExhausted as err:
            self._answer(rid, error=err)
        return rid, self._flush()

    def cancel(self, rid: RequestId) -> list[Action]:
        """The caller of `rid` left: its scoring job, not started yet, never runs; a flight it
        waited for goes on for the others."""
        request = self._requests.pop(rid, None)
        if request is not None:
            if request.job is not None and not request.job.started:
                request.job.cancelled = True
            flight = None if request.key is None else self.flights.get(request.key)
            if flight is not None and rid in flight.waiters:
                flight.waiters.remove(rid)
        return self._flush()

    # -- events: compute -------------------------------------------------------------------

    def worker_free(self) -> list[Action]:
        """The worker is idle: its next step, if any (jobs that must not start are settled)."""
        assert self._running is None, "one step at a time"
        job, dropped = self.queues.take()
        for gone in dropped:
            self._ended(gone, JobEnd.CANCELLED if gone.cancelled else JobEnd.EXPIRED)
        if job is not None:
            if not job.started_ns:
                job.started_ns = self._wall_ns()
            self._running = job
            self._actions.append(RunStep(job))
        return self._flush()

    def step_done(self, job: Job, result: Any, seconds: float = 0.0) -> list[Action]:
        """`job`'s step ran for `seconds` and produced `result` (its product so far)."""
        assert self._running is job
        self._running = None
        job.seconds += seconds
        ms = job.next_step_ms
        if job.steps_run + 1 < len(job.step_ms):  # one prediction per step; a scoring job one
            job.partial = result
            self.queues.stepped(job, ms)
            return self._flush()
        job.steps_run += 1
        job.finished_ns = self._wall_ns()
        job.partial = None
        self.queues.end(job, "done")
        self._computed(job)
        self._ended(job, JobEnd.DONE, result)
        return self._flush()

    def step_failed(self, job: Job, error: BaseException) -> list[Action]:
        """`job`'s step raised `error`: the job fails, and with it what waits for it."""
        assert self._running is job
        self._running = None
        job.finished_ns = self._wall_ns()
        self.queues.end(job, "failed")
        self._ended(job, JobEnd.FAILED, error=error)
        return self._flush()

    # -- events: fetch ---------------------------------------------------------------------

    def fetch_done(
        self, key: CacheKey, kv: KV | None, producer: Origin | None = None
    ) -> list[Action]:
        """The fetch of `key` ended: `kv` checked on receipt (None: no peer delivered it in
        time: it is computed instead), made by `producer`."""
        flight = self.flights[key]
        assert flight.state is FlightState.FETCHING
        if kv is not None:
            if not flight.relay and producer is not None:
                flight.origin = producer  # a Rank's: the content is its producer's
            # may not fit; the waiters still use it
            self.store.put_device(key, kv, pin_for=flight.pin_for, origin=flight.origin)
            del self.flights[key]
            self._landed(flight, kv)
            return self._flush()
        chunk = (
            self.settings.prefill_chunk_tokens
            if flight.fallback_priority is Priority.BACKGROUND
            else None
        )
        source, spec, computed, step_ms = self._plan(key, flight.prefix, chunk)
        if source is Source.RELOAD and not flight.relay:
            flight.origin = self._reload_origin(key, flight.origin)
        try:
            job = self._submit(key, source, spec, step_ms, flight.fallback_priority,
                               flight.fallback_deadline, flight.due, flight.tag)  # fmt: skip
        except ResourceExhausted as err:
            del self.flights[key]
            self._failed(flight, err)
            return self._flush()
        flight.state, flight.job, flight.source = FlightState.COMPUTING, job, source
        flight.computed_tokens = computed
        self._owner[job] = key
        return self._flush()

    # -- events: lifecycle -----------------------------------------------------------------

    def drain(self) -> list[Action]:
        """Refuse new pre-inference from now on; Ranks are still served."""
        self.draining = True
        return self._flush()

    def tick(self) -> list[Action]:
        """Time passed: pins past their window and stale host copies go."""
        self.store.expire()
        return self._flush()

    def cost_model_refitted(self, model: CostModel) -> None:
        """Decide with `model` from now on (the cost learner's refit)."""
        self.cost_model = model

    # -- PreInfer --------------------------------------------------------------------------

    def _pre_infer(
        self,
        request: _Request,
        relay_window_s: float | None,
        rank_expected_in_s: float | None,
        origin: Origin | None,
    ) -> None:
        if self.draining:
            raise Unavailable("ranker is draining: send pre-inference elsewhere")
        if not self.settings.relay_enabled:
            raise Unavailable("relay is disabled on this ranker (bypass): nothing to pre-infer")
        window = relay_window_s or self.settings.relay_window_s
        if window > self.settings.max_relay_window_s:
            raise InvalidInput(
                f"relay window {window * 1e3:.0f} ms is over this ranker's limit of "
                f"{self.settings.max_relay_window_s * 1e3:.0f} ms (max_relay_window_ms)"
            )
        prefix = request.prefix
        key = request.key = self.key(prefix)
        request.window_s, request.own = window, origin
        self._requests[request.rid] = request
        if self.store.get(key, Tier.HBM) is not None:
            self._pin(request, PreInferOutcome.ALREADY_RESIDENT)
            return
        flight = self.flights.get(key)
        if flight is not None:
            request.role = _Role.JOINED
            flight.waiters.append(request.rid)
            return
        nbytes = (prefix.user_features + prefix.behaviours) * self._bytes_per_token
        if not self.store.fits_device(nbytes):
            del self._requests[request.rid]
            usage = self.store.usage(Tier.HBM)
            raise ResourceExhausted(
                f"prefix of {prefix.user_features + prefix.behaviours} tokens needs {nbytes} "
                f"bytes; the device tier has {usage.budget_bytes - usage.pinned_bytes} bytes not "
                "pinned by other relays"
            )
        due = self.clock() + (rank_expected_in_s or window)
        try:
            flight = self._start(key, prefix, Priority.BACKGROUND, request.deadline, window,
                                 origin, due, request.tag)  # fmt: skip
        except ResourceExhausted:
            del self._requests[request.rid]
            raise
        flight.waiters.append(request.rid)

    def _pin(self, request: _Request, outcome: PreInferOutcome) -> None:
        assert request.key is not None
        kv = self.store.get(request.key, Tier.HBM)
        if kv is None or not self.store.put_device(
            request.key, kv, pin_for=request.window_s, origin=request.own
        ):
            self._answer(request.rid, error=ResourceExhausted(
                "the device tier cannot hold this prefix beside pinned relays"))  # fmt: skip
            return
        self._observe(PreInferServed(request.prefix, outcome, kv, request.window_s))
        held = self._held_of(kv)
        self._answer(
            request.rid, PreInferAnswer(outcome, request.key, held.num_tokens, held.nbytes)
        )

    # -- Rank ------------------------------------------------------------------------------

    def _rank(self, r: _Request) -> None:
        assert r.rank is not None
        request = r.rank
        if not self.settings.relay_enabled:
            r.outcome = CacheOutcome.BYPASS
            r.computed = history_tokens(request) + request.candidates
            self._score(r, FullForward(request), "full", ())
            return
        key = r.key = self.key(request.prefix)
        kv = self.store.get(key, Tier.HBM)
        held = self.store.peek(key, Tier.HBM)
        r.relayed = held is not None and held.pinned
        r.consumed = held.origin if kv is not None and held is not None else None
        r.computed = request.short_term + request.candidates
        if kv is not None:
            self._score_prefix(r, kv)
            return
        flight = self.flights.get(key)
        if flight is not None:
            if self._take_over(key, flight, r.prefix, r.deadline, r.own):
                r.role = _Role.OWN
            else:
                self._hasten(flight, r.deadline)
                r.role, r.outcome = _Role.WAITING, CacheOutcome.WAITED_INFLIGHT
                r.consumed, r.relayed = flight.origin, flight.relay
            flight.waiters.append(r.rid)
            return
        self._compute_own(r)

    def _compute_own(self, r: _Request) -> None:
        assert r.key is not None
        flight = self._start(r.key, r.prefix, Priority.RANK, r.deadline, None, r.own, tag=r.tag)
        r.role = _Role.OWN
        flight.waiters.append(r.rid)

    def _score_prefix(self, r: _Request, kv: KV) -> None:
        assert r.rank is not None
        self._score(r, Score(r.rank, kv), "rank", ())

    def _score(self, r: _Request, spec: Spec, name: str, step_ms: tuple[float, ...]) -> None:
        r.role = _Role.SCORING
        job = self._queue(name, spec, Priority.RANK, r.deadline, None, step_ms, r.tag)
        r.job = job
        self._owner[job] = r.rid

    def _scored(self, r: _Request, scores: Any) -> None:
        assert r.rank is not None
        if r.key is not None:
            self.store.consume(r.key)
        consumed = r.consumed if r.consumed != r.own else None
        self._observe(RankServed(r.rank, r.outcome, r.computed, consumed))
        self._answer(r.rid, RankAnswer(r.outcome, r.computed, r.relayed, scores))

    # -- flights ---------------------------------------------------------------------------

    def _start(
        self,
        key: CacheKey,
        prefix: PrefixRef,
        priority: Priority,
        deadline: float | None,
        pin_for: float | None,
        origin: Origin | None,
        due: float | None = None,
        tag: Any = None,
    ) -> Flight:
        """The cheapest way to make `key` device-resident, as the key's one flight. Background
        work runs in chunks, so that ranks overtake it; rank work in one call."""
        chunk = self.settings.prefill_chunk_tokens if priority is Priority.BACKGROUND else None
        peers = self._fetch_peers(key)
        source, spec, computed, step_ms = self._plan(key, prefix, chunk, peers)
        if source is Source.FETCH:
            flight = Flight(key, prefix, FlightState.FETCHING, source, 0, pin_for, due, origin)
            flight.tag = tag
            flight.fallback_priority, flight.fallback_deadline = priority, deadline
            self.flights[key] = flight
            nbytes = (prefix.user_features + prefix.behaviours) * self._bytes_per_token
            self._actions.append(StartFetch(key, tuple(peers), nbytes, prefix.user_features))
            return flight
        if source is Source.RELOAD and pin_for is None:
            origin = self._reload_origin(key, origin)
        job = self._submit(key, source, spec, step_ms, priority, deadline, due, tag)
        flight = Flight(key, prefix, FlightState.COMPUTING, source, computed, pin_for, due,
                        origin, job, tag=tag)  # fmt: skip
        self.flights[key] = flight
        self._owner[job] = key
        return flight

    def _submit(
        self,
        key: CacheKey,
        source: Source,
        spec: Spec | None,
        step_ms: tuple[float, ...],
        priority: Priority,
        deadline: float | None,
        due: float | None,
        tag: Any,
    ) -> Job:
        return self._queue(f"{source}:{key.user_id}", spec, priority, deadline, due, step_ms, tag)

    def _queue(
        self,
        name: str,
        spec: Spec | None,
        priority: Priority,
        deadline: float | None,
        due: float | None,
        step_ms: tuple[float, ...],
        tag: Any = None,
    ) -> Job:
        try:
            job = self.queues.submit(name, spec, priority, deadline, due=due, step_ms=step_ms,
                                     submitted_ns=self._wall_ns())  # fmt: skip
        except Overloaded as err:
            raise ResourceExhausted(str(err)) from err
        job.tag = tag
        return job

    def _take_over(
        self,
        key: CacheKey,
        flight: Flight,
        prefix: PrefixRef,
        deadline: float | None,
        origin: Origin | None,
    ) -> bool:
        """Whether a Rank computes its prefix itself rather than wait for its in-flight job:
        background work still queued is restarted as the Rank's one call when the cost model
        predicts that sooner than the job's remaining chunks (each chunk pays a call's fixed
        cost). Rank work, a taken job and a fetch are waited for."""
        job = flight.job
        if job is None or job.priority is not Priority.BACKGROUND:
            return False
        source, spec, computed, step_ms = self._plan(key, prefix, None)
        if not sooner(sum(step_ms), job.remaining_ms) or not self.queues.restart(
            job, spec, step_ms, deadline
        ):
            return False
        flight.source, flight.computed_tokens = source, computed
        flight.pin_for, flight.taken_over = None, True
        if source is Source.RELOAD:
            flight.origin = self._reload_origin(key, origin)
        return True

    def _hasten(self, flight: Flight, deadline: float | None) -> None:
        """A Rank waits for `flight`: its job runs next, at rank priority; a running fetch's
        fallback, should the fetch fail, computes at rank priority by the earliest deadline."""
        if flight.job is not None:
            self.queues.promote(flight.job, deadline)
            return
        flight.fallback_priority = Priority.RANK
        if deadline is not None:
            old = flight.fallback_deadline
            flight.fallback_deadline = deadline if old is None else min(old, deadline)

    def _reload_origin(self, key: CacheKey, origin: Origin | None) -> Origin | None:
        """A reload's content is its host copy's: it keeps the copy's producer when known."""
        entry = self.store.peek(key, Tier.DRAM)
        return entry.origin if entry is not None and entry.origin is not None else origin

    def _fetch_peers(self, key: CacheKey) -> list[Any]:
        """None without peer fetch, or when a host copy of `key` is here (reloading it is this
        ranker's own business)."""
        if self._peers is None or self.store.peek(key, Tier.DRAM) is not None:
            return []
        return self._peers.peers(key)

    def _plan(
        self, key: CacheKey, prefix: PrefixRef, chunk: int | None, peers: list[Any] | None = None
    ) -> tuple[Source, Spec | None, int, tuple[float, ...]]:
        """The cheapest way to make `key` device-resident (`plan.cheapest`): its source, job
        (None: a fetch), the prefix tokens it computes and each step's predicted time."""
        held = self.store.peek(key, Tier.DRAM)
        base = self._extendable(key, prefix)
        fetch_ms = None
        if peers and self._peers is not None:
            nbytes = (prefix.user_features + prefix.behaviours) * self._bytes_per_token
            fetch_ms = self._peers.transfer_ms(nbytes)
        costed = cheapest(
            self.cost_model,
            prefix.user_features,
            prefix.behaviours,
            None if held is None else self._held_of(held.kv),
            None if base is None else self._held_of(base),
            chunk,
            fetch_ms,
        )
        size = chunk if chunk is not None else max(prefix.user_features + prefix.behaviours, 1)
        spec: Spec | None = None
        if costed.source is Source.RELOAD:
            assert held is not None
            spec = Reload(held.kv)
        elif costed.source is Source.EXTEND:
            assert base is not None
            spec = Extend(prefix, base, self._held_of(base).num_behaviours, size)
        elif costed.source is Source.PREFILL:
            spec = Prefill(prefix, size)
        return costed.source, spec, costed.computed_tokens, costed.step_ms

    def _extendable(self, key: CacheKey, prefix: PrefixRef) -> KV | None:
        """The user's newest cached prefix that is a strict prefix of `prefix` (its digest is
        that of `prefix`'s head of the same length), if any."""
        for old in self.store.user_keys(key.user_id, key.model_version):
            tier = self.store.tier_of(old)
            entry = self.store.peek(old, tier) if tier is not None else None
            if entry is None:
                continue
            n = self._held_of(entry.kv).num_behaviours
            if n < prefix.behaviours and prefix.head_digest(n) == old.digest:
                return entry.kv
        return None

    # -- endings ---------------------------------------------------------------------------

    def _ended(
        self, job: Job, end: JobEnd, result: Any = None, error: BaseException | None = None
    ) -> None:
        owner = self._owner.pop(job, None)
        if end is JobEnd.EXPIRED:
            error = DeadlineExceeded(f"{job.name}: deadline passed while queued")
        if isinstance(owner, CacheKey):
            flight = self.flights.pop(owner)
            work = _WORK[flight.source]
            if end is JobEnd.DONE:
                self.store.put_device(owner, result, pin_for=flight.pin_for, origin=flight.origin)
                self._observe(JobEnded(job, work, end, flight.computed_tokens, result))
                self._landed(flight, result)
            else:
                self._observe(JobEnded(job, work, end))
                self._failed(flight, error)
            return
        self._observe(JobEnded(job, work_of(job.spec), end))
        r = None if owner is None else self._requests.get(owner)
        if r is None:
            return  # its caller left
        if end is JobEnd.DONE:
            self._scored(r, result)
        elif end is not JobEnd.CANCELLED:
            self._answer(r.rid, error=error)

    def _landed(self, flight: Flight, kv: KV) -> None:
        for rid in flight.waiters:
            r = self._requests.get(rid)
            if r is None:
                continue
            if r.role is _Role.STARTED:
                taken = flight.taken_over
                self._pin(r, PreInferOutcome.JOINED_INFLIGHT if taken
                          else PRE_INFER_OUTCOME[flight.source])  # fmt: skip
            elif r.role is _Role.JOINED:
                self._actions.append(Waited(rid))
                self._pin(r, PreInferOutcome.JOINED_INFLIGHT)
            else:
                if r.role is _Role.WAITING:
                    self._actions.append(Waited(rid))
                else:
                    self._own_landed(r, flight)
                try:
                    self._score_prefix(r, kv)
                except ResourceExhausted as err:
                    self._answer(rid, error=err)

    def _own_landed(self, r: _Request, flight: Flight) -> None:
        r.outcome = RANK_OUTCOME[flight.source]
        r.computed += flight.computed_tokens
        r.relayed = False
        # a reload's or a fetch's content was produced elsewhere: link to its producer
        r.consumed = flight.origin if flight.source in (Source.RELOAD, Source.FETCH) else None

    def _failed(self, flight: Flight, error: BaseException | None) -> None:
        for rid in flight.waiters:
            r = self._requests.get(rid)
            if r is None:
                continue
            if r.role in (_Role.JOINED, _Role.WAITING):
                self._actions.append(Waited(rid))
            if r.role is _Role.WAITING and isinstance(error, DeadlineExceeded):
                try:  # its pre-infer gave up: compute it
                    self._compute_own(r)
                except ResourceExhausted as err:
                    self._answer(rid, error=err)
                continue
            self._answer(rid, error=error)

    def _computed(self, job: Job) -> None:
        spec = job.spec
        if isinstance(spec, Prefill):
            tokens = spec.prefix.user_features + spec.prefix.behaviours
            self._observe(Computed(Work.PREFILL, tokens, None, 0, job.seconds))
        elif isinstance(spec, Extend):
            tokens = spec.prefix.user_features + spec.prefix.behaviours
            cached = spec.prefix.user_features + spec.base_behaviours
            self._observe(Computed(Work.EXTEND, tokens, cached, 0, job.seconds))
        elif isinstance(spec, Score):
            request = spec.request
            cached = self._held_of(spec.kv).num_tokens
            self._observe(Computed(Work.RANK, history_tokens(request), cached,
                                   request.candidates, job.seconds))  # fmt: skip
        elif isinstance(spec, FullForward):
            request = spec.request
            self._observe(Computed(Work.FULL_FORWARD, history_tokens(request), None,
                                   request.candidates, job.seconds))  # fmt: skip

    # -- plumbing --------------------------------------------------------------------------

    def _new_id(self) -> RequestId:
        self._next_id += 1
        return RequestId(self._next_id)

    def _answer(
        self,
        rid: RequestId,
        result: PreInferAnswer | RankAnswer | None = None,
        error: BaseException | None = None,
    ) -> None:
        self._requests.pop(rid, None)
        self._actions.append(Answer(rid, result, error))

    def _flush(self) -> list[Action]:
        actions, self._actions = self._actions, []
        if self._record is not None:
            for action in actions:
                self._record(action)
        return actions
