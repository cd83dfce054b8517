"""The relay on one ranker: PreInfer builds and pins a prefix cache, Rank consumes it."""

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass, replace
from typing import Any

import torch

from relaygr.behaviours import Prefix, RankInput
from relaygr.cost import CostModel
from relaygr.errors import DeadlineExceeded, InvalidInput, ResourceExhausted, Unavailable
from services.ranker.digest import PrefixHasher
from services.ranker.fetch import Peer, PeerFetch
from services.ranker.kv_store import CacheKey, KVStore, Tier
from services.ranker.model import RankingModel
from services.ranker.observer import EngineObserver, NoopObserver, Operation, Origin, Work
from services.ranker.outcomes import CacheOutcome, PreInferOutcome
from services.ranker.plan import PRE_INFER_OUTCOME, RANK_OUTCOME, Held, Source, cheapest, sooner
from services.ranker.prefix_kv import PrefixKV
from services.ranker.scheduler import ComputeScheduler, Job, Priority, Steps
from services.ranker.validation import validate_prefix, validate_rank_input

_WORK = {
    Source.RELOAD: Work.RELOAD,
    Source.EXTEND: Work.EXTEND,
    Source.PREFILL: Work.PREFILL,
}  # a fetch is no compute job: it lands as one of these when it falls back


@dataclass(frozen=True, slots=True)
class EngineSettings:
    relay_enabled: bool
    relay_window_s: float
    prefill_chunk_tokens: int
    max_relay_window_s: float = 60.0  # a longer pin asked for is refused: it would hold memory


@dataclass(frozen=True, slots=True)
class PreInferResult:
    outcome: PreInferOutcome
    key: CacheKey
    tokens: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class RankResult:
    scores: torch.Tensor  # [tasks, candidates], on the CPU
    outcome: CacheOutcome
    computed_tokens: int
    # The consumed prefix was produced or pinned by a PreInfer (a relay), not left by an
    # earlier request (a cross-visit hit) nor computed by this Rank.
    relayed: bool = False


@dataclass(slots=True)
class _Fallback:
    """How a peer fetch's key is computed if the fetch fails: a Rank that joins the fetch lifts
    it to rank priority, under the earliest deadline."""

    priority: Priority
    deadline: float | None


@dataclass(eq=False, slots=True)
class _Inflight:
    job: Job | None  # None while a peer fetch runs (nothing submitted to compute yet)
    task: asyncio.Task[PrefixKV]
    source: Source
    computed_tokens: int  # prefix tokens this job computes (0 for a reload or a fetch)
    relay: bool  # started by a PreInfer (its entry lands pinned for a relay window)
    # What the landed entry records as its origin: the requester, except that a Rank's reload
    # of a host copy keeps the copy's producer (the content is the same).
    origin: Origin | None = None
    # A Rank restarted this PreInfer's job as its own computation (it was predicted sooner).
    taken_over: bool = False
    fallback: _Fallback | None = None  # a peer fetch's, while it runs


@dataclass(frozen=True, slots=True)
class _Plan:
    """How to make a prefix device-resident: the job's steps and each step's predicted time."""

    source: Source
    steps: Steps | None  # None for a peer fetch: it runs on the event loop, not the worker
    computed_tokens: int  # prefix tokens it computes (0 for a reload or a fetch)
    step_ms: tuple[float, ...]


class RankerEngine:
    """Serves PreInfer and Rank against one model, one KV store and one compute scheduler.

    Runs on one asyncio loop; the store and the in-flight table are touched only from it, the
    model only from the scheduler's worker. Per cache key at most one computation or reload is
    in flight (single flight): a PreInfer or Rank that finds one joins it. Background prefill is
    ordered by when its Rank is expected. A Rank that finds background work for its prefix
    either waits for it, promoting it to rank priority, or restarts it as its own one-call
    computation, whichever the cost model predicts finishes first. A finished prefix is stored
    before it leaves the in-flight table, so no request ever sees neither. A miss is served by
    full inference, computed as prefill + rank (the same work), which leaves the prefix cached
    for return visits. Waits, jobs and the origin of each cache go to the observer; what it does
    changes nothing.

    With `peer_fetch` (None: never), a missing prefix that a peer may hold is fetched from it
    when the transfer is predicted sooner than every local way (`plan.cheapest`). The fetch is
    the key's one in-flight entry: requests for the key join it (a Rank waits, lifting the
    fallback to rank priority), and when no peer delivers a checked entry in time, the same
    entry goes on to compute the prefix exactly as it would have, so a fetch never fails a
    request.
    """

    def __init__(
        self,
        model: RankingModel,
        store: KVStore[PrefixKV],
        scheduler: ComputeScheduler,
        cost_model: CostModel,
        settings: EngineSettings,
        observer: EngineObserver | None = None,
        peer_fetch: PeerFetch | None = None,
    ) -> None:
        """`observer` None: nothing observed (a no-op observer); `peer_fetch` None: a miss is
        never fetched from a peer."""
        self.model = model
        self.store = store
        self.scheduler = scheduler
        self.cost_model = cost_model
        self.settings = settings
        self._observer: EngineObserver = observer or NoopObserver()
        self._inflight: dict[CacheKey, _Inflight] = {}
        self.draining = False
        self.peer_fetch = peer_fetch

    def inflight(self) -> int:
        """Prefix computations and reloads in flight."""
        return len(self._inflight)

    # -- hand-off hook (services/ranker/handoff_intake.py) ---------------------------------

    def computing(self, key: CacheKey) -> bool:
        """Whether the prefix `key` is being computed or reloaded here now."""
        return key in self._inflight

    # -- PreInfer --------------------------------------------------------------------------

    async def pre_infer(
        self,
        prefix: Prefix,
        relay_window_s: float | None,
        deadline: float | None,
        rank_expected_in_s: float | None = None,
    ) -> PreInferResult:
        """`rank_expected_in_s`: when its Rank is expected, from now (None: unknown, assume the
        end of the relay window); background prefill runs earliest expected Rank first."""
        validate_prefix(prefix, self.model.cfg)
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
        key = self._key(prefix)
        origin = self._observer.origin(Operation.PRE_INFER)
        if self.store.get(key, Tier.HBM) is not None:
            outcome = PreInferOutcome.ALREADY_RESIDENT
        elif key in self._inflight:
            with self._observer.waiting_inflight():
                await asyncio.shield(self._inflight[key].task)
            outcome = PreInferOutcome.JOINED_INFLIGHT
        else:
            nbytes = self._expected_bytes(prefix.num_tokens)
            if not self.store.fits_device(nbytes):
                raise ResourceExhausted(
                    f"prefix of {prefix.num_tokens} tokens needs {nbytes} bytes; the device "
                    f"tier has {self._free_for_pins()} bytes not pinned by other relays"
                )
            due = self.scheduler.clock() + (rank_expected_in_s or window)
            inflight = self._start(key, prefix, Priority.BACKGROUND, deadline, window, origin, due)
            await asyncio.shield(inflight.task)
            outcome = (
                PreInferOutcome.JOINED_INFLIGHT  # the computation became the Rank's
                if inflight.taken_over
                else PRE_INFER_OUTCOME[inflight.source]
            )
        kv = self.store.get(key, Tier.HBM)
        if kv is None or not self.store.put_device(key, kv, pin_for=window, origin=origin):
            raise ResourceExhausted("the device tier cannot hold this prefix beside pinned relays")
        self._observer.pre_infer_served(prefix, outcome, kv, window)
        return PreInferResult(outcome, key, kv.num_tokens, kv.nbytes)

    # -- Rank ------------------------------------------------------------------------------

    async def rank(self, request: RankInput, deadline: float | None) -> RankResult:
        validate_rank_input(request, self.model.cfg)
        candidates = len(request.candidates)
        if not self.settings.relay_enabled:
            scores = await self._run(
                "full",
                Work.FULL_FORWARD,
                self._timed(
                    self._once(lambda: self.model.full_forward(request)),
                    Work.FULL_FORWARD,
                    request.history_tokens,
                    None,
                    candidates,
                ),
                deadline,
            )
            computed = request.history_tokens + candidates
            self._observer.rank_served(request, CacheOutcome.BYPASS, computed, None)
            return RankResult(scores, CacheOutcome.BYPASS, computed)
        key = self._key(request.prefix)
        kv = self.store.get(key, Tier.HBM)
        held = self.store.peek(key, Tier.HBM)
        relayed = held is not None and held.pinned
        own = self._observer.origin(Operation.RANK)
        consumed = self._entry_origin(key, Tier.HBM) if kv is not None else None
        computed = len(request.short_term) + candidates
        outcome = CacheOutcome.HBM_HIT
        mine: _Inflight | None = None  # the computation of the prefix this Rank made
        if kv is None and key in self._inflight:
            inflight = self._inflight[key]
            if self._take_over(key, inflight, request.prefix, deadline, own):
                mine = inflight
                kv = await asyncio.shield(inflight.task)
            else:
                self._hasten(inflight, deadline)
                outcome = CacheOutcome.WAITED_INFLIGHT
                consumed = inflight.origin
                relayed = inflight.relay
                with (
                    self._observer.waiting_inflight(),
                    contextlib.suppress(DeadlineExceeded),  # its pre-infer gave up: compute below
                ):
                    kv = await asyncio.shield(inflight.task)
        if kv is None:
            mine = self._start(key, request.prefix, Priority.RANK, deadline, None, own)
            kv = await asyncio.shield(mine.task)
        if mine is not None:
            outcome = RANK_OUTCOME[mine.source]
            computed += mine.computed_tokens
            relayed = False
            # a reload's or a fetch's content was produced elsewhere: link to its producer
            consumed = mine.origin if mine.source in (Source.RELOAD, Source.FETCH) else None
        scores = await self._run(
            "rank",
            Work.RANK,
            self._timed(
                self._once(
                    lambda: self.model.rank(
                        kv, request.short_term, request.candidates, request.request_ts
                    )
                ),
                Work.RANK,
                request.history_tokens,
                kv.num_tokens,
                candidates,
            ),
            deadline,
        )
        self.store.consume(key)
        self._observer.rank_served(
            request, outcome, computed, consumed if consumed != own else None
        )
        return RankResult(scores, outcome, computed, relayed)

    # -- a peer's fetch ----------------------------------------------------------------------

    def held_for_peer(self, key: CacheKey) -> tuple[PrefixKV, Origin | None] | None:
        """The entry held under exactly `key` (HBM first, else its host copy) and its origin,
        for a peer that missed it; None when neither tier holds it. A peek: the entry keeps its
        place in the LRU order and its pin, and a host copy is not brought to the device."""
        entry = self.store.peek_any(key)
        return None if entry is None else (entry.kv, entry.origin)

    # -- lifecycle -------------------------------------------------------------------------

    async def drain(self) -> None:
        """Refuse new pre-inference and wait for every in-flight prefix to land."""
        self.draining = True
        while self._inflight:
            await asyncio.gather(
                *(asyncio.shield(i.task) for i in self._inflight.values()),
                return_exceptions=True,
            )

    # -- internals -------------------------------------------------------------------------

    def _key(self, prefix: Prefix) -> CacheKey:
        digest = PrefixHasher.start(prefix.user_features).absorb(prefix.long_term).digest()
        return CacheKey(prefix.user_id, self.model.model_version, digest)

    def _expected_bytes(self, tokens: int) -> int:
        return tokens * self.model.cfg.cache_bytes_per_token

    def _free_for_pins(self) -> int:
        usage = self.store.usage(Tier.HBM)
        return usage.budget_bytes - usage.pinned_bytes

    def _start(
        self,
        key: CacheKey,
        prefix: Prefix,
        priority: Priority,
        deadline: float | None,
        pin_for: float | None,
        origin: Origin | None = None,
        due: float | None = None,
    ) -> _Inflight:
        """Submit the cheapest way to make `key` device-resident, as the one in-flight job.

        `pin_for` is the relay window of a PreInfer (None: a Rank's); `origin` the requester's;
        `due` when the result is wanted (orders background work). Background work runs in
        chunks, so that ranks overtake it; rank work in one call (rank jobs run first-in
        first-out and a started one resumes first, so chunks would only add calls).
        """
        chunk = self.settings.prefill_chunk_tokens if priority is Priority.BACKGROUND else None
        peers = self._fetch_peers(key)
        plan = self._plan(key, prefix, chunk, peers)
        if plan.steps is None:  # a peer fetch
            fallback = _Fallback(priority, deadline)
            fetch = self._fetch_then_land(key, prefix, peers, pin_for, due)
            return self._enter(key, None, fetch, plan, pin_for, origin, fallback)
        if plan.source is Source.RELOAD and pin_for is None:
            origin = self._reload_origin(key, origin)
        job = self._submit(key, plan, priority, deadline, due)
        return self._enter(key, job, self._land(key, job, pin_for), plan, pin_for, origin)

    def _submit(
        self,
        key: CacheKey,
        plan: _Plan,
        priority: Priority,
        deadline: float | None,
        due: float | None,
    ) -> Job:
        assert plan.steps is not None
        return self.scheduler.submit(
            f"{plan.source}:{key.user_id}",
            plan.steps,
            priority,
            deadline,
            due=due,
            step_ms=plan.step_ms,
        )

    def _enter(
        self,
        key: CacheKey,
        job: Job | None,
        landing: Coroutine[Any, Any, PrefixKV],
        plan: _Plan,
        pin_for: float | None,
        origin: Origin | None,
        fallback: _Fallback | None = None,
    ) -> _Inflight:
        """Run `landing` as the key's one in-flight entry."""
        # `landing` first runs on the loop's next turn, when the entry below is in the table.
        task = asyncio.get_running_loop().create_task(landing)
        # Its waiters may all be gone (deadline, disconnect): the outcome is then nobody's.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        inflight = _Inflight(
            job, task, plan.source, plan.computed_tokens, pin_for is not None, origin
        )
        inflight.fallback = fallback
        self._inflight[key] = inflight
        return inflight

    def _take_over(
        self,
        key: CacheKey,
        inflight: _Inflight,
        prefix: Prefix,
        deadline: float | None,
        origin: Origin | None,
    ) -> bool:
        """Whether a Rank computes its prefix itself rather than wait for its in-flight job.

        Waiting promotes the job, so its remaining chunks run next; computing takes one call in
        the same place. Rank work is waited for; background work is restarted as the Rank's
        one call when the cost model predicts that call finishes sooner than the job's
        remaining chunks (each chunk pays a call's fixed cost), so one computation per key
        still holds. The job's current chunk cannot be stopped: a job on the worker is waited
        for.
        """
        job = inflight.job
        if job is None or job.priority is not Priority.BACKGROUND:
            return False
        plan = self._plan(key, prefix, None)
        assert plan.steps is not None  # no peers given: never a fetch
        if not sooner(sum(plan.step_ms), job.remaining_ms) or not self.scheduler.restart(
            job, plan.steps, plan.step_ms, deadline
        ):
            plan.steps.close()
            return False
        inflight.source, inflight.computed_tokens = plan.source, plan.computed_tokens
        inflight.relay, inflight.taken_over = False, True
        if plan.source is Source.RELOAD:
            inflight.origin = self._reload_origin(key, origin)
        return True

    def _reload_origin(self, key: CacheKey, origin: Origin | None) -> Origin | None:
        """A reload's content is its host copy's: it keeps the copy's producer when known."""
        held = self._entry_origin(key, Tier.DRAM)
        return held if held is not None else origin

    # -- peer fetch ------------------------------------------------------------------------

    def _fetch_peers(self, key: CacheKey) -> list[Peer]:
        """The peers to fetch `key` from: none without peer fetch, or when a host copy of it is
        here (reloading it is this ranker's own business)."""
        if self.peer_fetch is None or self.store.peek(key, Tier.DRAM) is not None:
            return []
        return self.peer_fetch.peers(key)

    def _hasten(self, inflight: _Inflight, deadline: float | None) -> None:
        """A Rank waits for `inflight`: its job runs next, at rank priority (`promote`); a
        running peer fetch's fallback, should the fetch fail, computes at rank priority, by the
        earliest deadline of those waiting."""
        if inflight.job is not None:
            self.scheduler.promote(inflight.job, deadline)
            return
        fallback = inflight.fallback
        if fallback is None:
            return
        fallback.priority = Priority.RANK
        if deadline is not None:
            fallback.deadline = (
                deadline if fallback.deadline is None else min(fallback.deadline, deadline)
            )

    async def _fetch_then_land(
        self,
        key: CacheKey,
        prefix: Prefix,
        peers: list[Peer],
        pin_for: float | None,
        due: float | None,
    ) -> PrefixKV:
        """The in-flight entry of a fetch: land the fetched prefix; or, when no peer delivers
        it, compute it as `_start` would have without peers (the same entry goes on)."""
        inflight = self._inflight[key]
        assert self.peer_fetch is not None and inflight.fallback is not None
        landing = False
        try:
            fetched, attempts = await self.peer_fetch.fetch(
                key,
                peers,
                self._expected_bytes(prefix.num_tokens),
                len(prefix.user_features),
                lambda: self._remaining_s(inflight),
            )
            producer = None
            for attempt in attempts:
                producer = self._observer.remote_origin(attempt.origin_traceparent)
                self._observer.fetched(
                    attempt.peer.instance_id, attempt.result, attempt.nbytes,
                    attempt.seconds, attempt.start_ns, producer,
                )  # fmt: skip
            if fetched is not None:
                if pin_for is None and producer is not None:
                    inflight.origin = producer  # a Rank's: the content is its producer's
                kv = fetched.kv
                # may not fit; the waiters still use it
                self.store.put_device(key, kv, pin_for=pin_for, origin=inflight.origin)
                return kv
            fallback, inflight.fallback = inflight.fallback, None
            chunk = (
                self.settings.prefill_chunk_tokens
                if fallback.priority is Priority.BACKGROUND
                else None
            )
            plan = self._plan(key, prefix, chunk)
            if plan.source is Source.RELOAD and pin_for is None:
                inflight.origin = self._reload_origin(key, inflight.origin)
            job = self._submit(key, plan, fallback.priority, fallback.deadline, due)
            inflight.job, inflight.source = job, plan.source
            inflight.computed_tokens = plan.computed_tokens
            landing = True
            return await self._land(key, job, pin_for)
        finally:
            if not landing:
                del self._inflight[key]

    def _remaining_s(self, inflight: _Inflight) -> float | None:
        """Time left before the deadline a fetch's fallback must meet (None: none)."""
        deadline = None if inflight.fallback is None else inflight.fallback.deadline
        return None if deadline is None else deadline - self.scheduler.clock()

    # -- landing ---------------------------------------------------------------------------

    async def _land(self, key: CacheKey, job: Job, pin_for: float | None) -> PrefixKV:
        inflight = self._inflight[key]  # its source may change while queued (a Rank's take-over)
        try:
            kv: PrefixKV = await asyncio.wrap_future(job.future)
            # may not fit; the waiters still use it
            self.store.put_device(key, kv, pin_for=pin_for, origin=inflight.origin)
            self._observer.prefix_landed(job, _WORK[inflight.source], inflight.computed_tokens, kv)
            return kv
        except BaseException:
            self._observer.prefix_failed(job, _WORK[inflight.source])
            raise
        finally:
            del self._inflight[key]

    def _plan(
        self, key: CacheKey, prefix: Prefix, chunk: int | None, peers: list[Peer] | None = None
    ) -> _Plan:
        """The cheapest way to make `key` device-resident (`plan.cheapest`) and its steps:
        computing in `chunk`-token steps (None: one call). With `peers` (that may hold it),
        fetching from them is a candidate, at the transfer cost in use."""
        device = self.model.device
        held = self.store.peek(key, Tier.DRAM)
        base = self._extendable(key, prefix)
        fetch_ms = None
        if peers and self.peer_fetch is not None:
            fetch_ms = self.peer_fetch.transfer.ms(self._expected_bytes(prefix.num_tokens))
        costed = cheapest(
            self.cost_model,
            len(prefix.user_features),
            len(prefix.long_term),
            None if held is None else _held(held.kv, device),
            None if base is None else _held(base, device),
            chunk,
            fetch_ms,
        )
        if costed.source is Source.FETCH:
            return _Plan(costed.source, None, 0, costed.step_ms)
        size = chunk if chunk is not None else max(prefix.num_tokens, 1)
        steps: Generator[None, None, Any]
        if costed.source is Source.RELOAD:
            assert held is not None
            host = held.kv
            steps = self._once(lambda: host.to(device))
        elif costed.source is Source.EXTEND:
            assert base is not None
            steps = self._timed(
                self._extend_steps(base, prefix, size),
                Work.EXTEND,
                prefix.num_tokens,
                base.num_tokens,
                0,
            )
        else:
            steps = self._timed(
                self._prefill_steps(prefix, size), Work.PREFILL, prefix.num_tokens, None, 0
            )
        return _Plan(costed.source, steps, costed.computed_tokens, costed.step_ms)

    def _extendable(self, key: CacheKey, prefix: Prefix) -> PrefixKV | None:
        """The user's newest cached prefix that is a strict prefix of `prefix`, if any, with
        the hasher of its content (a prefix received from a peer came with its digest only)."""
        for old in self.store.user_keys(key.user_id, key.model_version):
            tier = self.store.tier_of(old)
            entry = self.store.peek(old, tier) if tier is not None else None
            if entry is None or entry.kv.num_behaviours >= len(prefix.long_term):
                continue
            head = prefix.long_term.slice(0, entry.kv.num_behaviours)
            hasher = PrefixHasher.start(prefix.user_features).absorb(head)
            if hasher.digest() == old.digest:
                return replace(entry.kv, hasher=hasher)
        return None

    def _prefill_steps(self, prefix: Prefix, chunk: int) -> Generator[None, None, PrefixKV]:
        """Chunked prefill: the first chunk prefills, the rest extend (the same operation)."""
        first = max(chunk - len(prefix.user_features), 0)
        head = Prefix(prefix.user_id, prefix.user_features, prefix.long_term.slice(0, first))
        kv = self.model.prefill(head)
        yield
        return (yield from self._extend_from(kv, prefix, first, chunk))

    def _extend_steps(
        self, base: PrefixKV, prefix: Prefix, chunk: int
    ) -> Generator[None, None, PrefixKV]:
        kv = base.to(self.model.device)  # a host-tier base is brought over first
        yield
        return (yield from self._extend_from(kv, prefix, base.num_behaviours, chunk))

    def _extend_from(
        self, kv: PrefixKV, prefix: Prefix, start: int, chunk: int
    ) -> Generator[None, None, PrefixKV]:
        for begin in range(start, len(prefix.long_term), chunk):
            kv = self.model.extend(kv, prefix.long_term.slice(begin, begin + chunk))
            yield
        return kv

    def _timed(
        self,
        steps: Generator[None, None, Any],
        work: Work,
        tokens: int,
        cached_tokens: int | None,
        candidates: int,
    ) -> Generator[None, None, Any]:
        """`steps`, reporting their compute time once they complete (`EngineObserver.computed`).

        Only the steps themselves are timed, on the worker: not the queue before them nor other
        jobs run between them, so the cost model learns compute, not load.
        """
        seconds = 0.0
        try:
            while True:
                start = time.perf_counter()
                try:
                    next(steps)
                except StopIteration as done:
                    self._sync()
                    seconds += time.perf_counter() - start
                    self._observer.computed(work, tokens, cached_tokens, candidates, seconds)
                    return done.value
                self._sync()
                seconds += time.perf_counter() - start
                yield
        finally:
            steps.close()  # a job cancelled between steps: its generator ends with it

    def _sync(self) -> None:
        # A GPU runs kernels asynchronously: wait for them, or the time is the launch's.
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    @staticmethod
    def _once(fn: Callable[[], Any]) -> Generator[None, None, Any]:
        return fn()
        yield  # a one-step job

    async def _run(
        self, name: str, work: Work, steps: Generator[None, None, Any], deadline: float | None
    ) -> Any:
        job = self.scheduler.submit(name, steps, Priority.RANK, deadline)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.future.cancel()  # not started yet: never run it
            raise
        finally:
            self._observer.ranked(job, work)

    def _entry_origin(self, key: CacheKey, tier: Tier) -> Origin | None:
        entry = self.store.peek(key, tier)
        return None if entry is None else entry.origin


def _held(kv: PrefixKV, device: torch.device) -> Held:
    return Held(kv.num_behaviours, kv.num_tokens, kv.nbytes, kv.device == device)
