"""The ranker core's service driver: asyncio requests in, the model on one compute worker thread.

Every decision is `RankerCore`'s (services/ranker/core.py); this driver feeds it the events,
runs the actions (a model step on the worker, a peer fetch on the loop) and resolves each
request's future with its answer.
"""

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from relaygr.behaviours import Prefix, RankInput, UserId
from relaygr.cost import CostModel
from services.ranker.compute_worker import ComputeWorker
from services.ranker.core import RankerCore
from services.ranker.core_types import (
    Action,
    Answer,
    BatchComputed,
    Computed,
    CoreSettings,
    CoreStats,
    Extend,
    FullForward,
    JobEnd,
    JobEnded,
    Kept,
    Observation,
    Prefill,
    PreInferAnswer,
    PreInferServed,
    RankAnswer,
    RankServed,
    Reload,
    RequestId,
    RunBatch,
    RunStep,
    Score,
    StartFetch,
    Waited,
    chunk_span,
)
from services.ranker.digest import PrefixDigest, PrefixHasher
from services.ranker.fetch import PeerFetch
from services.ranker.kv_store import CacheKey, KVStore
from services.ranker.model import Extension, RankingModel, RankItem
from services.ranker.observer import EngineObserver, NoopObserver, Operation, Origin, Work
from services.ranker.outcomes import CacheOutcome, PreInferOutcome
from services.ranker.plan import Held
from services.ranker.prefix_kv import PrefixKV
from services.ranker.queues import ComputeQueues, Job
from services.ranker.validation import validate_prefix, validate_rank_input

__all__ = [
    "CacheOutcome",
    "EngineSettings",
    "Executor",
    "PreInferOutcome",
    "PreInferResult",
    "RankResult",
    "RankerEngine",
]

EngineSettings = CoreSettings  # the core's settings, by the name the service knew them

# How the worker runs one step of a job (`step` computes it): tests advance a virtual clock. A
# batched call is run as the step of its first job.
Executor = Callable[[Job, Callable[[], Any]], Any]


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


class ServicePrefix:
    """A `Prefix` as the core sees it (`core_types.PrefixRef`): its digest and its heads'."""

    __slots__ = ("_heads", "digest", "prefix")

    def __init__(self, prefix: Prefix) -> None:
        self.prefix = prefix
        self.digest: PrefixDigest = (
            PrefixHasher.start(prefix.user_features).absorb(prefix.long_term).digest()
        )
        self._heads: dict[int, PrefixHasher] = {}

    @property
    def user_id(self) -> UserId:
        return UserId(self.prefix.user_id)

    @property
    def user_features(self) -> int:
        return len(self.prefix.user_features)

    @property
    def behaviours(self) -> int:
        return len(self.prefix.long_term)

    def head_hasher(self, behaviours: int) -> PrefixHasher:
        hasher = self._heads.get(behaviours)
        if hasher is None:
            head = self.prefix.long_term.slice(0, behaviours)
            hasher = self._heads[behaviours] = PrefixHasher.start(self.prefix.user_features).absorb(
                head
            )
        return hasher

    def head_digest(self, behaviours: int) -> PrefixDigest:
        return self.head_hasher(behaviours).digest()


@dataclass(frozen=True, slots=True)
class ServiceRank:
    """A `RankInput` as the core sees it (`core_types.RankRef`)."""

    prefix: ServicePrefix
    request: RankInput

    @property
    def short_term(self) -> int:
        return len(self.request.short_term)

    @property
    def candidates(self) -> int:
        return len(self.request.candidates)


def _direct(job: Job, step: Callable[[], Any]) -> Any:
    return step()


def _context_of(job: Job) -> contextvars.Context | None:
    """The context (trace) of the request that caused `job`, if the engine tagged it."""
    return job.tag if isinstance(job.tag, contextvars.Context) else None


def _service_rank(request: Any) -> RankInput:
    assert isinstance(request, ServiceRank)
    return request.request


class RankerEngine:
    """Serves PreInfer and Rank against one model through one `RankerCore`.

    Runs on one asyncio loop: the core is fed only from it. The model runs only on the compute
    worker, one call at a time (a step, or a batch of scoring steps or of prefill chunks): the
    core's next call is asked for whenever the worker is idle, and a call's results come back
    to the loop as events, one per job. Observations go to `observer`, in the context (trace)
    of the request that caused them: each job of a batch is reported in its own request's
    context.
    """

    def __init__(
        self,
        model: RankingModel,
        store: KVStore[PrefixKV],
        cost_model: CostModel,
        settings: CoreSettings,
        observer: EngineObserver | None = None,
        peer_fetch: PeerFetch | None = None,
        clock: Callable[[], float] = time.monotonic,
        executor: Executor = _direct,
        record: Callable[[Action], None] | None = None,
    ) -> None:
        """`observer` None: nothing observed; `peer_fetch` None: a miss is never fetched;
        `record`: sees the core's every action (`RankerCore`)."""
        self.model = model
        self.settings = settings
        self.peer_fetch = peer_fetch
        self._observer: EngineObserver = observer or NoopObserver()
        device = model.device
        self.core: RankerCore[PrefixKV] = RankerCore(
            store,
            cost_model,
            settings,
            model.model_version,
            model.cfg.cache_bytes_per_token,
            lambda kv: Held(kv.num_behaviours, kv.num_tokens, kv.nbytes, kv.device == device),
            clock,
            self._observe,
            peer_fetch,
            time.time_ns,
            record,
        )
        self.worker = ComputeWorker(on_idle=self._idle_from_worker)
        self._executor = executor
        self._answers: dict[RequestId, asyncio.Future[Any]] = {}
        self._waits: dict[RequestId, asyncio.Future[None]] = {}
        self._contexts: dict[Job, contextvars.Context] = {}
        self._stepping = False
        self._quiet: list[asyncio.Future[None]] = []
        self._fetches: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- queries ---------------------------------------------------------------------------

    @property
    def store(self) -> KVStore[PrefixKV]:
        return self.core.store

    @property
    def queues(self) -> ComputeQueues:
        return self.core.queues

    @property
    def cost_model(self) -> CostModel:
        return self.core.cost_model

    @property
    def draining(self) -> bool:
        return self.core.draining

    def inflight(self) -> int:
        """Prefix computations, reloads and fetches in flight."""
        return self.core.inflight()

    def computing(self, key: CacheKey) -> bool:
        """Whether the prefix `key` is being computed, reloaded or fetched here now."""
        return self.core.computing(key)

    def held_for_peer(self, key: CacheKey) -> tuple[PrefixKV, Origin | None] | None:
        """The entry held under exactly `key` (HBM first, else its host copy) and its origin,
        for a peer that missed it; None when neither tier holds it (a peek)."""
        entry = self.core.held_for_peer(key)
        return None if entry is None else (entry.kv, entry.origin)

    def stats(self) -> CoreStats:
        """The core's typed snapshot (`RankerCore.stats`)."""
        return self.core.stats()

    def tick(self) -> None:
        """Time passed: relays past their window and stale host copies go (`RankerCore.tick`)."""
        self._apply(self.core.tick())

    def key(self, prefix: Prefix) -> CacheKey:
        """The cache key of `prefix` on this ranker."""
        return self.core.key(ServicePrefix(prefix))

    def cost_model_refitted(self, model: CostModel) -> None:
        self.core.cost_model_refitted(model)

    # -- requests --------------------------------------------------------------------------

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
        self._enter()
        origin = self._observer.origin(Operation.PRE_INFER)
        rid, actions = self.core.pre_infer(
            ServicePrefix(prefix), relay_window_s, deadline, rank_expected_in_s, origin,
            contextvars.copy_context(),
        )  # fmt: skip
        answer: PreInferAnswer = await self._outcome(rid, actions)
        return PreInferResult(answer.outcome, answer.key, answer.tokens, answer.nbytes)

    async def rank(self, request: RankInput, deadline: float | None) -> RankResult:
        validate_rank_input(request, self.model.cfg)
        self._enter()
        origin = self._observer.origin(Operation.RANK)
        ref = ServiceRank(ServicePrefix(request.prefix), request)
        rid, actions = self.core.rank(ref, deadline, origin, contextvars.copy_context())
        answer: RankAnswer = await self._outcome(rid, actions)
        return RankResult(answer.scores, answer.outcome, answer.computed_tokens, answer.relayed)

    # -- lifecycle -------------------------------------------------------------------------

    async def drain(self) -> None:
        """Refuse new pre-inference and wait for every in-flight prefix to land."""
        self._enter()
        self._apply(self.core.drain())
        await self._until(lambda: not self.core.inflight())

    async def close(self) -> None:
        """Finish every queued job, then end the worker."""
        self._enter()
        await self._until(lambda: not self._busy())
        await asyncio.to_thread(self.worker.stop)

    def stop(self) -> None:
        """End the worker (no loop: whatever is queued is dropped)."""
        self.worker.stop()

    # -- feeding the core ------------------------------------------------------------------

    def _enter(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def _outcome(self, rid: RequestId, actions: list[Action]) -> Any:
        assert self._loop is not None
        answer = self._answers[rid] = self._loop.create_future()
        waited = self._waits[rid] = self._loop.create_future()
        self._apply(actions)
        try:
            if self.core.waiting(rid):
                with self._observer.waiting_inflight():
                    await waited
            return await answer
        except asyncio.CancelledError:
            self._apply(self.core.cancel(rid))
            raise
        finally:
            self._answers.pop(rid, None)
            self._waits.pop(rid, None)

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Answer):
                future = self._answers.get(action.request)
                waited = self._waits.get(action.request)
                if waited is not None and not waited.done():
                    waited.set_result(None)
                if future is None or future.done():
                    continue
                if action.error is not None:
                    future.set_exception(action.error)
                else:
                    future.set_result(action.result)
            elif isinstance(action, Waited):
                waited = self._waits.get(action.request)
                if waited is not None and not waited.done():
                    waited.set_result(None)
            elif isinstance(action, RunStep):
                self._dispatch((action.job,))
            elif isinstance(action, RunBatch):
                self._dispatch(action.jobs)
            elif isinstance(action, StartFetch):
                assert self._loop is not None
                task = self._loop.create_task(self._fetch(action))
                self._fetches.add(task)
                task.add_done_callback(self._fetches.discard)
        self._kick()
        if self._quiet:
            self._check_quiet()

    def _kick(self) -> None:
        if not self._stepping and self.worker.idle:
            actions = self.core.worker_free()
            if actions:
                self._apply(actions)

    def _idle_from_worker(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._kick)  # closed meanwhile: the worker ignores it

    # -- compute ---------------------------------------------------------------------------

    def _dispatch(self, jobs: tuple[Job, ...]) -> None:
        assert self._loop is not None
        loop = self._loop
        self._stepping = True
        context = _context_of(jobs[0])  # a batch's other jobs are reported in their own

        def done(result: Any, error: BaseException | None, seconds: float) -> None:
            loop.call_soon_threadsafe(self._stepped, jobs, result, error, seconds, context=context)

        self.worker.run(lambda: self._timed_call(jobs), done)

    def _timed_call(self, jobs: tuple[Job, ...]) -> tuple[Any, float]:
        start = time.perf_counter()
        head = jobs[0]
        step = (lambda: self._step(head)) if len(jobs) == 1 else (lambda: self._step_batch(jobs))
        result = self._executor(head, step)
        if self.model.device.type == "cuda":
            # A GPU runs kernels asynchronously: wait for them, or the time is the launch's.
            torch.cuda.synchronize(self.model.device)
        return result, time.perf_counter() - start

    def _stepped(
        self, jobs: tuple[Job, ...], result: Any, error: BaseException | None, seconds: float
    ) -> None:
        """A call came back (in its first job's context): each job's end is reported in its
        own request's context; the worker is asked for its next call once all of them are."""
        core, single = self.core, len(jobs) == 1
        if error is not None:
            self._stepping = False
            self._apply(
                core.step_failed(jobs[0], error) if single else core.batch_failed(jobs, error)
            )
            return
        if single:
            self._stepping = False
            self._apply(core.step_done(jobs[0], result, seconds))
            return
        actions = core.step_done(jobs[0], result[0], seconds)
        for job, own in zip(jobs[1:], result[1:], strict=True):
            context = _context_of(job)
            if context is None:
                actions += core.step_done(job, own, seconds)
            else:
                actions += context.run(core.step_done, job, own, seconds)
        self._stepping = False
        self._apply(actions)

    def _step(self, job: Job) -> Any:
        """One step of `job`, on the worker: what the spec says, nothing decided here."""
        spec, model = job.spec, self.model
        if isinstance(spec, Prefill | Extend) and chunk_span(spec, job.steps_run) is not None:
            return model.chunk_batch([self._chunk(job)])[0]
        if isinstance(spec, Extend):  # its first step: a host-tier base is brought over first
            prefix = spec.prefix
            assert isinstance(prefix, ServicePrefix)
            base: PrefixKV = spec.base.to(model.device)
            return replace(base, hasher=prefix.head_hasher(spec.base_behaviours))
        if isinstance(spec, Reload):
            host: PrefixKV = spec.host
            return host.to(model.device)
        if isinstance(spec, Score):
            rank = spec.request
            assert isinstance(rank, ServiceRank)
            r = rank.request
            return model.rank(spec.kv, r.short_term, r.candidates, r.request_ts)
        assert isinstance(spec, FullForward)
        return self._full([job])[0]

    def _chunk(self, job: Job) -> Prefix | Extension:
        """The prefill chunk `job`'s next step computes (`chunk_span`): the user features and
        the first behaviours from nothing, or the next behaviours on what its steps so far
        made (`job.partial`)."""
        spec = job.spec
        assert isinstance(spec, Prefill | Extend) and isinstance(spec.prefix, ServicePrefix)
        span = chunk_span(spec, job.steps_run)
        assert span is not None
        p = spec.prefix.prefix
        before, after = (tokens - len(p.user_features) for tokens in span)
        if isinstance(spec, Prefill) and job.steps_run == 0:
            return Prefix(p.user_id, p.user_features, p.long_term.slice(0, after))
        return Extension(job.partial, p.long_term.slice(before, after))

    def _step_batch(self, jobs: tuple[Job, ...]) -> list[Any]:
        """The steps of a batch (all Score, all FullForward, or all prefill chunks), as one
        model call: each job's product (scores, or its prefix so far), in order."""
        head = jobs[0].spec
        if isinstance(head, Prefill | Extend):
            return self.model.chunk_batch([self._chunk(job) for job in jobs])
        if isinstance(head, Score):
            ranks = [_service_rank(job.spec.request) for job in jobs]
            return self.model.rank_batch(
                [
                    RankItem(job.spec.kv, r.short_term, r.candidates, r.request_ts)
                    for job, r in zip(jobs, ranks, strict=True)
                ]
            )
        return self._full(jobs)

    def _full(self, jobs: Sequence[Job]) -> list[Any]:
        """Full inferences in one call: each job's scores, or (`FullForward.keep`) its scores
        and its prefix (`Kept`)."""
        ranks = [_service_rank(job.spec.request) for job in jobs]
        keep = [job.spec.keep for job in jobs]
        done = self.model.full_forward_keeping(ranks, keep)
        return [scores if kv is None else Kept(scores, kv) for scores, kv in done]

    # -- fetch -----------------------------------------------------------------------------

    async def _fetch(self, action: StartFetch) -> None:
        assert self.peer_fetch is not None
        key, core = action.key, self.core

        def remaining() -> float | None:
            deadline = core.fetch_deadline(key)
            return None if deadline is None else deadline - core.clock()

        kv: PrefixKV | None = None
        producer = None
        try:
            fetched, attempts = await self.peer_fetch.fetch(
                key, list(action.peers), action.nbytes, action.user_tokens, remaining
            )
            for attempt in attempts:
                producer = self._observer.remote_origin(attempt.origin_traceparent)
                self._observer.fetched(
                    attempt.peer.instance_id, attempt.result, attempt.nbytes,
                    attempt.seconds, attempt.start_ns, producer,
                )  # fmt: skip
            kv = None if fetched is None else fetched.kv
        finally:  # a fetch never fails a request: without an entry, the core computes it
            self._apply(core.fetch_done(key, kv, producer if kv is not None else None))

    # -- observation -----------------------------------------------------------------------

    def _observe(self, event: Observation) -> None:
        observer = self._observer
        if isinstance(event, JobEnded):
            if event.work in (Work.RANK, Work.FULL_FORWARD):
                observer.ranked(event.job, event.work, event.call)
            elif event.end is JobEnd.DONE and event.kv is not None:
                observer.prefix_landed(event.job, event.work, event.computed_tokens, event.kv)
            else:
                observer.prefix_failed(event.job, event.work)
        elif isinstance(event, Computed):
            observer.computed(
                event.work, event.tokens, event.cached_tokens, event.candidates, event.seconds
            )
        elif isinstance(event, BatchComputed):
            observer.batch_computed(event.call.work, event.call.shapes, event.seconds)
        elif isinstance(event, PreInferServed):
            prefix = event.prefix
            assert isinstance(prefix, ServicePrefix)
            observer.pre_infer_served(prefix.prefix, event.outcome, event.kv, event.window_s)
        elif isinstance(event, RankServed):
            rank = event.request
            assert isinstance(rank, ServiceRank)
            observer.rank_served(rank.request, event.outcome, event.computed_tokens, event.consumed)

    # -- waiting for quiet -----------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self.core.inflight() or self._stepping or self.core.queued())

    async def _until(self, condition: Callable[[], bool]) -> None:
        assert self._loop is not None
        while not condition():
            quiet = self._loop.create_future()
            self._quiet.append(quiet)
            await quiet

    def _check_quiet(self) -> None:
        quiet, self._quiet = self._quiet, []
        for future in quiet:
            if not future.done():
                future.set_result(None)
