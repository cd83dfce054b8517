"""The ranker's decisions, synchronous: PreInfer builds and pins a prefix cache, Rank consumes it.

Events in (a request arrived, a step or a fetch ended, the worker is free, drain began, a tick),
actions out (`core_types`: run this step, start this fetch, stop waiting, answer). No I/O, no
clock read: the service (services/ranker/engine.py) and the simulator (tooling/sim/ranker.py)
drive this one copy.
"""

from collections.abc import Callable
from typing import Any, Generic

from relaygr.bucket_counts import BucketCounts
from relaygr.cost import CostModel
from relaygr.errors import DeadlineExceeded, InvalidInput, ResourceExhausted, Unavailable
from services.ranker.batching import BatchRoom, CallKind, batched_backlog_ms, call_kind
from services.ranker.core_types import (
    BATCH_REQUEST_BOUNDS,
    BATCH_ROW_BOUNDS,
    KV,
    Action,
    Answer,
    BatchComputed,
    CoreSettings,
    CoreStats,
    FullForward,
    JobEnd,
    JobEnded,
    Kept,
    Observation,
    PrefixRef,
    PreInferAnswer,
    PreInferServed,
    RankAnswer,
    RankRef,
    RankServed,
    RequestId,
    RunBatch,
    RunStep,
    Score,
    ScoringCall,
    Spec,
    StartFetch,
    Waited,
    call_shape,
    computed_of,
    history_tokens,
    work_of,
)
from services.ranker.digest import ModelVersion
from services.ranker.flight import Flight, FlightState, Pending, Role
from services.ranker.handoff_order import Candidate, Declined, admit_received, held_candidates
from services.ranker.kv_store import CacheKey, Entry, KVStore, Tier
from services.ranker.outcomes import CacheOutcome, Origin, PreInferOutcome, Work
from services.ranker.plan import PRE_INFER_OUTCOME, RANK_OUTCOME, Held, Source, sooner
from services.ranker.planner import PeerPlanner, Planner
from services.ranker.queues import ComputeQueues, Job, Overloaded, Priority
from services.ranker.relay_waits import RelayWaits

_WORK = {Source.RELOAD: Work.RELOAD, Source.EXTEND: Work.EXTEND, Source.PREFILL: Work.PREFILL}


Observer = Callable[[Observation], None]


class RankerCore(Generic[KV]):
    """One ranker's request flow over one KV store and one set of compute queues.

    Per cache key at most one computation, reload or fetch is in flight (single flight): a
    PreInfer or Rank that finds one joins it. Background prefill is ordered by when its Rank is
    expected. A Rank that finds background work for its prefix either waits for it, promoting it
    to rank priority, or restarts it as its own one-call computation, whichever the cost model
    predicts finishes first. A finished prefix is stored before it leaves the in-flight table,
    so no request ever sees neither. A Rank that must compute its prefix from nothing does so
    in one call, the full inference, which also keeps the prefix's K/V (`FullForward.keep`):
    the same scores and prefix as a prefill and then a rank, one call's overhead instead of
    two, and it batches with other full inferences; the prefix stays cached for return visits.
    With `peers`, a missing prefix a peer may hold is fetched when that is predicted sooner
    than every local way; when no peer delivers it, the same flight computes it, so a fetch
    never fails a request.

    The driver runs one model call at a time: it asks `worker_free` for the next when its
    worker is idle. A call is one job's step, or the steps of several jobs batched
    (`RunBatch`, `batching.BatchRoom`): the Score steps (or full inferences) at the head of the
    rank queue when the worker frees, in rank order; or, when no rank work is queued, the
    background prefill chunks (several users' Prefill or Extend steps) at the head of the
    background queue, in its order. Either within `CoreSettings.max_batch_requests` and
    `max_batch_rows` (a chunk's rows: its new tokens). A batch never waits for more to arrive;
    a step joins only when sharing the call pays: each joiner saves half its own call, or
    `CoreSettings.batch_backlog` jobs are queued in the head's queue. As every Rank of a call is
    answered when the call ends, one joins only while the call is predicted to end before every
    deadline in it. A cancelled or expired Rank never joins one; background work never joins
    rank work nor rank work background work, and a Rank arriving meanwhile still runs at the
    next free worker, ahead of every queued chunk; a prefix job's later chunks go back to the
    background queue, each step batched anew. Each job of a batch ends with its own result; if
    the call fails, its jobs return to their queues, in their places, and each runs alone from
    then on (one bad request fails itself only, and a call too large for the device still
    serves its requests). A prefix job that shared a call reports no `Computed` time (its
    time holds other users' chunks). Observations go to `observe`, in the order they happen;
    nothing it does changes a decision.
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
        self.settings = settings
        self.model_version = model_version
        self._planner = Planner(store, cost_model, kv_bytes_per_token, held_of, peers)
        self.queues = ComputeQueues(settings.max_queued(), clock)
        self.clock = clock
        self._held_of = held_of
        self._observe = observe or (lambda _: None)
        self._wall_ns = wall_ns
        self.flights: dict[CacheKey, Flight] = {}
        # Device bytes the relay flights will pin when they land (their `reserved_bytes`): a
        # PreInfer is admitted only if its prefix fits beside the pinned and the reserved, so
        # no prefill is computed that could not be pinned.
        self._reserved_bytes = 0
        self.relay_waits = RelayWaits()  # how long relays waited for their Rank
        self._requests: dict[RequestId, Pending] = {}
        self._owner: dict[Job, CacheKey | RequestId] = {}  # a job's flight key or Rank
        self._next_id = 0
        self._running: list[Job] = []  # the running call's jobs not yet reported
        self._call: ScoringCall | None = None  # the running call, when it scores
        self._shared = False  # the running call is a batch (two or more jobs' steps)
        self._batch_requests = BucketCounts.empty(BATCH_REQUEST_BOUNDS)
        self._batch_rows = BucketCounts.empty(BATCH_ROW_BOUNDS)
        self._chunk_requests = BucketCounts.empty(BATCH_REQUEST_BOUNDS)
        self._chunk_rows = BucketCounts.empty(BATCH_ROW_BOUNDS)
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
        return request is not None and request.role in (Role.JOINED, Role.WAITING)

    def queued(self) -> int:
        """Jobs queued or running."""
        return len(self._running) + sum(self.queues.depth(p) for p in Priority)

    def stats(self) -> CoreStats:
        """A snapshot for the metrics and Describe (reading changes nothing)."""
        return CoreStats(
            {tier: self.store.usage(tier) for tier in Tier},
            self.store.stats,
            {p: self.queues.depth(p) for p in Priority},
            self.queues.queued_background_ms(),
            len(self.flights),
            self.cost_model,
            self.queued_rank_ms(),
            self._batch_requests,
            self._batch_rows,
            self._chunk_requests,
            self._chunk_rows,
            self.relay_waits.p99_ms(),
        )

    def queued_rank_ms(self) -> float:
        """Predicted compute of rank work queued or running, batched as this core batches it
        (`batched_backlog_ms`): what a Rank arriving now waits behind, as Describe reports it
        to the trigger."""
        queues = self.queues
        return batched_backlog_ms(
            self.cost_model, self.settings, queues.queued_rank_ms(), queues.queued_rank_jobs()
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
        """Every held prefix, most valuable first (`handoff_order.value_order`), for a drain."""
        return held_candidates(self.store)

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
        request = Pending(rid, Role.STARTED, None, prefix, deadline, tag=tag)
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
        r = Pending(rid, Role.SCORING, None, request.prefix, deadline, rank=request, own=origin,
                     tag=tag, arrived=self.clock())  # fmt: skip
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
        """The worker is idle: its next call, if any (jobs that must not start are settled).
        A scoring step takes the scoring steps queued right behind it into its call, a
        background prefill chunk the background chunks queued right behind it."""
        assert not self._running, "one call at a time"
        job, dropped = self.queues.take()
        self._settle(dropped)
        if job is None:
            return self._flush()
        jobs = [job]
        kind = call_kind(job)
        if kind is not None:
            backlog = 1 + self.queues.depth(job.priority)
            room = BatchRoom(
                job, self.settings, self._held_of, self.cost_model, self.clock(), backlog
            )
            if self.settings.max_batch_requests > 1:  # 1: as before batching, exactly
                more, dropped = self.queues.take_more(room.joins, priority=job.priority)
                jobs += more
                self._settle(dropped)
            if kind is CallKind.CHUNK:
                self._chunk_requests = self._chunk_requests.observed(room.requests)
                self._chunk_rows = self._chunk_rows.observed(room.rows)
            else:
                self._batch_requests = self._batch_requests.observed(room.requests)
                self._batch_rows = self._batch_rows.observed(room.rows)
        now_ns = self._wall_ns()
        for taken in jobs:
            if not taken.started_ns:
                taken.started_ns = now_ns
        self._running, self._call = jobs, self._scoring_call(jobs)
        self._shared = len(jobs) > 1
        self._actions.append(RunStep(job) if len(jobs) == 1 else RunBatch(tuple(jobs)))
        return self._flush()

    def step_done(self, job: Job, result: Any, seconds: float = 0.0) -> list[Action]:
        """`job`'s step ran for `seconds` and produced `result` (its product so far); a job of a
        batch: its own result, `seconds` the whole call's."""
        assert job in self._running, "not a running step"
        self._running.remove(job)
        job.seconds += seconds
        job.batched |= self._shared
        ms = job.next_step_ms
        if job.steps_run + 1 < len(job.step_ms):  # one prediction per step; a scoring job one
            job.partial = result
            self.queues.stepped(job, ms)
            return self._flush()
        job.steps_run += 1
        job.finished_ns = self._wall_ns()
        job.partial = None
        self.queues.end(job, "done")
        call = self._call
        if not job.batched:
            computed = computed_of(job, self._held_of)
            if computed is not None:
                self._observe(computed)
        elif call is not None and not self._running:
            # A scoring batch's last job: its time is no one request's alone. (A prefix job
            # that shared a call for any chunk reports no time at all: its `seconds` hold
            # other users' chunks.)
            self._observe(BatchComputed(call, seconds))
        self._ended(job, JobEnd.DONE, result, call=call)
        return self._flush()

    def step_failed(self, job: Job, error: BaseException) -> list[Action]:
        """`job`'s step raised `error`: the job fails, and with it what waits for it."""
        assert self._running == [job], "not the running step"
        self._running = []
        job.finished_ns = self._wall_ns()
        self.queues.end(job, "failed")
        self._ended(job, JobEnd.FAILED, error=error, call=self._call)
        return self._flush()

    def batch_failed(self, jobs: tuple[Job, ...], error: BaseException) -> list[Action]:
        """The batched call of `jobs` raised `error`: each job goes back to its queue (the rank
        queue's head for scoring steps, the background order for prefill chunks), in its place,
        its step not run, to run alone from now on (`Job.solo`); only a job that fails alone
        fails its request."""
        assert tuple(self._running) == jobs, "not the running batch"
        self._running, self._call = [], None
        for job in jobs:
            job.solo = True
            self.queues.enqueue(job, resume=True)
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
            self._end_flight(key)
            self._landed(flight, kv)
            return self._flush()
        chunk = self._chunk(flight.fallback_priority)
        source, spec, computed, step_ms = self._planner.plan(key, flight.prefix, chunk)
        if source is Source.RELOAD and not flight.relay:
            flight.origin = self._planner.reload_origin(key, flight.origin)
        try:
            job = self._submit(key, source, spec, step_ms, flight.fallback_priority,
                               flight.fallback_deadline, flight.due, flight.tag)  # fmt: skip
        except ResourceExhausted as err:
            self._end_flight(key)
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

    @property
    def cost_model(self) -> CostModel:
        """The compute cost model decisions use now."""
        return self._planner.cost_model

    def cost_model_refitted(self, model: CostModel) -> None:
        """Decide with `model` from now on (the cost learner's refit)."""
        self._planner.cost_model = model

    # -- PreInfer --------------------------------------------------------------------------

    def _pre_infer(
        self,
        request: Pending,
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
            request.role = Role.JOINED
            flight.waiters.append(request.rid)
            return
        nbytes = self._planner.nbytes(prefix)
        if not self.store.fits_device(nbytes + self._reserved_bytes):
            del self._requests[request.rid]
            usage = self.store.usage(Tier.HBM)
            free = usage.budget_bytes - usage.pinned_bytes - self._reserved_bytes
            raise ResourceExhausted(
                f"prefix of {prefix.user_features + prefix.behaviours} tokens needs {nbytes} "
                f"bytes; the device tier has {max(free, 0)} bytes not pinned by other relays "
                "or reserved for those in flight"
            )
        due = self.clock() + (rank_expected_in_s or window)
        try:
            flight = self._start(key, prefix, Priority.BACKGROUND, request.deadline, window,
                                 origin, due, request.tag)  # fmt: skip
        except ResourceExhausted:
            del self._requests[request.rid]
            raise
        flight.reserved_bytes = nbytes
        self._reserved_bytes += nbytes
        flight.waiters.append(request.rid)

    def _end_flight(self, key: CacheKey) -> Flight:
        """Take `key`'s flight out of the table, releasing the room it reserved."""
        flight = self.flights.pop(key)
        self._release(flight)
        return flight

    def _release(self, flight: Flight) -> None:
        """`flight` will pin nothing (it ended, or is no longer a relay): its room is free."""
        self._reserved_bytes -= flight.reserved_bytes
        flight.reserved_bytes = 0

    def _pin(self, request: Pending, outcome: PreInferOutcome) -> None:
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

    def _rank(self, r: Pending) -> None:
        assert r.rank is not None
        request = r.rank
        if not self.settings.relay_enabled:
            r.outcome = CacheOutcome.BYPASS
            r.computed = history_tokens(request) + request.candidates
            self._score(r, FullForward(request), "full")
            return
        key = r.key = self.key(request.prefix)
        waited = self.store.rank_arrived(key)
        if waited is not None:
            self.relay_waits.add(waited)
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
            if self._take_over(key, flight, r):
                r.role = Role.OWN
            else:
                self._hasten(flight, r.deadline, r.arrived)
                r.role, r.outcome = Role.WAITING, CacheOutcome.WAITED_INFLIGHT
                r.consumed, r.relayed = flight.origin, flight.relay
            flight.waiters.append(r.rid)
            return
        self._compute_own(r)

    def _compute_own(self, r: Pending) -> None:
        assert r.key is not None
        flight = self._start(
            r.key, r.prefix, Priority.RANK, r.deadline, None, r.own, tag=r.tag, place=r.arrived,
            scores=r,
        )  # fmt: skip
        r.role = Role.OWN
        flight.waiters.append(r.rid)

    def _score_prefix(self, r: Pending, kv: KV) -> None:
        assert r.rank is not None
        self._score(r, Score(r.rank, kv), "rank")

    def _score(self, r: Pending, spec: Spec, name: str) -> None:
        r.role = Role.SCORING
        # Its one call's predicted time, counted in the rank work a Rank arriving now waits
        # behind (`queued_rank_ms`).
        step_ms = (self.cost_model.shape_ms(call_shape(spec, self._held_of, 0)),)
        # In the Rank's place: a miss scored after its prefill lands keeps the place it had.
        job = self._queue(name, spec, Priority.RANK, r.deadline, None, step_ms, r.tag, r.arrived)
        r.job = job
        self._owner[job] = r.rid

    def _scored(self, r: Pending, scores: Any) -> None:
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
        place: float | None = None,
        scores: Pending | None = None,
    ) -> Flight:
        """The cheapest way to make `key` device-resident, as the key's one flight. Background
        work runs in chunks, so that ranks overtake it; rank work in one call, in `place` (the
        arrival of the Rank it serves). The Rank `scores` computes its prefix from nothing as
        its full inference, keeping the prefix (`_one_call`)."""
        chunk = self._chunk(priority)
        peers = self._planner.fetch_peers(key)
        source, spec, computed, step_ms = self._planner.plan(key, prefix, chunk, peers)
        scores_for = None
        if scores is not None and source is Source.PREFILL:
            spec, step_ms = self._one_call(scores)
            scores_for = scores.rid
        if source is Source.FETCH:
            flight = Flight(key, prefix, FlightState.FETCHING, source, 0, pin_for, due, origin)
            flight.tag = tag
            flight.fallback_priority, flight.fallback_deadline = priority, deadline
            self.flights[key] = flight
            nbytes = self._planner.nbytes(prefix)
            self._actions.append(StartFetch(key, tuple(peers), nbytes, prefix.user_features))
            return flight
        if source is Source.RELOAD and pin_for is None:
            origin = self._planner.reload_origin(key, origin)
        job = self._submit(key, source, spec, step_ms, priority, deadline, due, tag, place)
        flight = Flight(key, prefix, FlightState.COMPUTING, source, computed, pin_for, due,
                        origin, job, tag=tag, scores_for=scores_for)  # fmt: skip
        self.flights[key] = flight
        self._owner[job] = key
        return flight

    def _chunk(self, priority: Priority) -> int | None:
        """The chunk work of `priority` runs in: background work in chunks sized from the cost
        model in use (`CoreSettings.background_chunk`), rank work in one call (None)."""
        if priority is not Priority.BACKGROUND:
            return None
        return self.settings.background_chunk(self.cost_model)

    def _one_call(self, r: Pending) -> tuple[FullForward, tuple[float, ...]]:
        """Rank `r`'s prefix computed from nothing with its scores: its full inference, keeping
        the prefix, and that call's predicted time."""
        assert r.rank is not None
        spec = FullForward(r.rank, keep=True)
        return spec, (self.cost_model.shape_ms(call_shape(spec, self._held_of)),)

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
        place: float | None = None,
    ) -> Job:
        name = f"{source}:{key.user_id}"
        return self._queue(name, spec, priority, deadline, due, step_ms, tag, place)

    def _queue(
        self,
        name: str,
        spec: Spec | None,
        priority: Priority,
        deadline: float | None,
        due: float | None,
        step_ms: tuple[float, ...],
        tag: Any = None,
        place: float | None = None,
    ) -> Job:
        try:
            job = self.queues.submit(name, spec, priority, deadline, due=due, step_ms=step_ms,
                                     submitted_ns=self._wall_ns(), place=place)  # fmt: skip
        except Overloaded as err:
            raise ResourceExhausted(str(err)) from err
        job.tag = tag
        return job

    def _take_over(self, key: CacheKey, flight: Flight, r: Pending) -> bool:
        """Whether Rank `r` computes its prefix itself rather than wait for its in-flight job:
        background work still queued is restarted as the Rank's one call when the cost model
        predicts that sooner than the job's remaining chunks (each chunk pays a call's fixed
        cost); from nothing, that call is the Rank's full inference, keeping the prefix. Rank
        work, a taken job and a fetch are waited for."""
        job = flight.job
        if job is None or job.priority is not Priority.BACKGROUND:
            return False
        source, spec, computed, step_ms = self._planner.plan(key, r.prefix, None)
        if not sooner(sum(step_ms), job.remaining_ms):
            return False
        if source is Source.PREFILL:
            spec, step_ms = self._one_call(r)
        if not self.queues.restart(job, spec, step_ms, r.deadline, r.arrived):
            return False
        flight.source, flight.computed_tokens = source, computed
        flight.pin_for, flight.taken_over = None, True
        self._release(flight)
        flight.scores_for = r.rid if source is Source.PREFILL else None
        if source is Source.RELOAD:
            flight.origin = self._planner.reload_origin(key, r.own)
        return True

    def _hasten(self, flight: Flight, deadline: float | None, place: float | None = None) -> None:
        """A Rank (arrived at `place`) waits for `flight`: its job runs at rank priority, in that
        Rank's place; a running fetch's fallback, should the fetch fail, computes at rank
        priority by the earliest deadline."""
        if flight.job is not None:
            self.queues.promote(flight.job, deadline, place)
            return
        flight.fallback_priority = Priority.RANK
        if deadline is not None:
            old = flight.fallback_deadline
            flight.fallback_deadline = deadline if old is None else min(old, deadline)

    # -- endings ---------------------------------------------------------------------------

    def _scoring_call(self, jobs: list[Job]) -> ScoringCall | None:
        """The call of `jobs` when it scores (their steps are Score or full inference)."""
        spec = jobs[0].spec
        if not isinstance(spec, Score | FullForward):
            return None
        shapes = tuple(call_shape(job.spec, self._held_of) for job in jobs)
        return ScoringCall(work_of(spec), shapes)

    def _ended(
        self,
        job: Job,
        end: JobEnd,
        result: Any = None,
        error: BaseException | None = None,
        call: ScoringCall | None = None,
    ) -> None:
        owner = self._owner.pop(job, None)
        if end is JobEnd.EXPIRED:
            error = DeadlineExceeded(f"{job.name}: deadline passed while queued")
        if isinstance(owner, CacheKey):
            flight = self._end_flight(owner)
            one_call = isinstance(job.spec, FullForward)
            work = work_of(job.spec) if one_call else _WORK[flight.source]
            if end is JobEnd.DONE:
                scores = None
                if isinstance(result, Kept):
                    scores, result = result.scores, result.kv
                self.store.put_device(owner, result, pin_for=flight.pin_for, origin=flight.origin)
                self._observe(JobEnded(job, work, end, flight.computed_tokens, result,
                                       call=call if one_call else None))  # fmt: skip
                self._landed(flight, result, scores)
            else:
                self._observe(JobEnded(job, work, end))
                self._failed(flight, error)
            return
        self._observe(JobEnded(job, work_of(job.spec), end, call=call))
        r = None if owner is None else self._requests.get(owner)
        if r is None:
            return  # its caller left
        if end is JobEnd.DONE:
            self._scored(r, result)
        elif end is not JobEnd.CANCELLED:
            self._answer(r.rid, error=error)

    def _landed(self, flight: Flight, kv: KV, scores: Any = None) -> None:
        """`flight` made `kv` device-resident: PreInfers pin it, Ranks score on it; the Rank
        its job scored as it computed (`Flight.scores_for`) is answered with `scores`."""
        for rid in flight.waiters:
            r = self._requests.get(rid)
            if r is None:
                continue
            if r.role is Role.STARTED:
                taken = flight.taken_over
                self._pin(r, PreInferOutcome.JOINED_INFLIGHT if taken
                          else PRE_INFER_OUTCOME[flight.source])  # fmt: skip
            elif r.role is Role.JOINED:
                self._actions.append(Waited(rid))
                self._pin(r, PreInferOutcome.JOINED_INFLIGHT)
            else:
                if r.role is Role.WAITING:
                    self._actions.append(Waited(rid))
                else:
                    self._own_landed(r, flight)
                if rid == flight.scores_for:
                    self._scored(r, scores)
                    continue
                try:
                    self._score_prefix(r, kv)
                except ResourceExhausted as err:
                    self._answer(rid, error=err)

    def _own_landed(self, r: Pending, flight: Flight) -> None:
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
            if r.role in (Role.JOINED, Role.WAITING):
                self._actions.append(Waited(rid))
            if r.role is Role.WAITING and isinstance(error, DeadlineExceeded):
                try:  # its pre-infer gave up: compute it
                    self._compute_own(r)
                except ResourceExhausted as err:
                    self._answer(rid, error=err)
                continue
            self._answer(rid, error=error)

    def _settle(self, dropped: list[Job]) -> None:
        """Jobs the queues dropped before their first step: cancelled or expired."""
        for gone in dropped:
            self._ended(gone, JobEnd.CANCELLED if gone.cancelled else JobEnd.EXPIRED)

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
