"""Which queued steps join the one the worker takes next, as one model call: scoring steps, or
background prefill chunks (docs/architecture.md §7, "Batches")."""

from collections.abc import Callable
from enum import StrEnum
from typing import Any

from relaygr.cost import CallShape, CostModel, batch_ms
from services.ranker.core_types import (
    CoreSettings,
    Extend,
    FullForward,
    Prefill,
    Score,
    call_rows,
    call_shape,
    chunk_span,
)
from services.ranker.plan import Held
from services.ranker.queues import Job, Priority


class CallKind(StrEnum):
    """The model entry point a batched call runs through: steps of one kind only share one."""

    SCORE = "score"  # cached Ranks' Score steps: RankingModel.rank_batch
    FULL = "full"  # full inferences: full_forward_batch
    CHUNK = "chunk"  # background prefill chunks, from nothing or on a cached prefix: chunk_batch


def call_kind(job: Job) -> CallKind | None:
    """The kind of call `job`'s next step may lead or join (None: it runs alone): a scoring
    step (a cached Rank's Score or a full inference), or a background prefix job's prefill
    chunk (`chunk_span`); never a step that already failed in a batched call. A prefix job
    promoted to rank priority runs alone: it serves a waiting Rank, which no one else's chunk
    should delay."""
    spec = job.spec
    if job.solo:
        return None
    if isinstance(spec, Score):
        return CallKind.SCORE
    if isinstance(spec, FullForward):
        return CallKind.FULL
    if (
        isinstance(spec, Prefill | Extend)
        and job.priority is Priority.BACKGROUND
        and chunk_span(spec, job.steps_run) is not None
    ):
        return CallKind.CHUNK
    return None


class BatchRoom:
    """One call as it is filled: its first step (`head`) is in; `joins` admits a further step
    while the call stays within `CoreSettings.max_batch_requests` and `max_batch_rows` (for a
    chunk call, `max_chunk_batch_rows` too).

    Only steps of the head's kind join (`call_kind`: Score with Score, full inference with full
    inference, background chunk with background chunk: one model entry point per call), and
    none that failed in a batch before. A step's rows are `call_rows` of its shape: a chunk's
    new tokens. The head is in whatever its rows, so a Rank larger than the row bound still
    runs, alone. The queues ask in their order and stop at the first refusal, so a step that
    does not fit keeps its place at the head of the queue rather than being overtaken by a
    smaller one behind it.

    A scoring step also joins only while the call, predicted by the cost model's batch term
    from `now`, still ends before the earliest deadline among its steps: every step of a batch
    is answered when the call ends, so a join that would hold an earlier Rank past its deadline
    is refused (that step runs in a later call). A chunk answers no one when its call ends
    (its job's deadline bounds only when it may start), so chunks have no such bound.

    And a step joins only when sharing the call pays (`pays`): every step of a call ends when
    the call ends, so a join delays the steps already in it by the joiner's time less its
    saving. Over the steps of one call, batching lowers their mean completion only when each
    joiner saves at least half its own single-call time (the cost model's `batch_saving_ms`
    against the joiner's `shape_ms`: two steps of time s, saving d, end at 2s - d batched, at s
    and 2s one by one). Short of that, batching still raises throughput, which repays the delay
    only when work is queued behind the call: so it batches when `backlog` (jobs queued in the
    head's queue, the head included) reaches `CoreSettings.batch_backlog`. At low load a burst
    of two or three Ranks (or PreInfers) then runs one by one, as unbatched, rather than every
    one of it ending last.
    """

    def __init__(
        self,
        head: Job,
        settings: CoreSettings,
        held_of: Callable[[Any], Held],
        cost: CostModel,
        now: float,
        backlog: int,
    ) -> None:
        kind = call_kind(head)
        assert kind is not None
        self.kind = kind
        self._settings = settings
        self._held_of = held_of
        self._cost = cost
        self._now = now
        self._backlogged = backlog >= settings.batch_backlog
        # A Rank arriving while a chunk call runs waits for all of it, so chunk calls have
        # their own, tighter row bound (by default one chunk's tokens: a Rank still waits at
        # most about one chunk, and what batches is the short last chunks of several prefixes).
        self._max_rows = (
            min(settings.max_batch_rows, settings.max_chunk_batch_rows)
            if kind is CallKind.CHUNK
            else settings.max_batch_rows
        )
        shape = call_shape(head.spec, held_of, head.steps_run)
        self._shapes: list[CallShape] = [shape]
        self._deadline = self._answered_by(head)
        self.requests = 1
        self.rows = call_rows(shape)

    def joins(self, job: Job) -> bool:
        if call_kind(job) is not self.kind:
            return False
        if self.requests >= self._settings.max_batch_requests:
            return False
        shape = call_shape(job.spec, self._held_of, job.steps_run)
        rows = call_rows(shape)
        if self.rows + rows > self._max_rows:
            return False
        if not (self._backlogged or pays(self._cost, shape)):
            return False
        deadline = _earliest(self._deadline, self._answered_by(job))
        shapes = [*self._shapes, shape]
        if deadline is not None and self._now + batch_ms(self._cost, shapes) / 1e3 > deadline:
            return False
        self._shapes, self._deadline = shapes, deadline
        self.requests += 1
        self.rows += rows
        return True

    def _answered_by(self, job: Job) -> float | None:
        """The deadline the call's end must meet for `job` (None: none, a chunk answers no
        one)."""
        return None if self.kind is CallKind.CHUNK else job.deadline


def batched_backlog_ms(
    cost: CostModel, settings: CoreSettings, single_ms: float, jobs: int
) -> float:
    """Predicted compute of `jobs` queued rank jobs that take `single_ms` one call each, run in
    the calls `BatchRoom` would fill, each job taken as their mean: what a Rank arriving now
    waits behind.

    Call by call, the head of what is left takes `max_batch_requests` jobs while at least
    `batch_backlog` are left or a mean job saves half its own call (`pays`), else runs alone; a
    call takes its jobs' time less `batch_saving_ms` for each after the first, never less than
    one job. Row and deadline bounds and jobs that must run alone (a promoted prefix job) can
    only split calls further; Ranks arriving later only join them. With no batching (one
    request a call, or no saving known), `single_ms`."""
    if jobs <= 1 or settings.max_batch_requests <= 1 or cost.batch_saving_ms <= 0:
        return single_ms
    mean_ms = single_ms / jobs
    anyway = 2 * cost.batch_saving_ms >= mean_ms
    total, left = 0.0, jobs
    while left > 0:
        size = min(left, settings.max_batch_requests)
        if not (anyway or left >= settings.batch_backlog):
            size = 1
        total += max(size * mean_ms - (size - 1) * cost.batch_saving_ms, mean_ms)
        left -= size
    return total


def pays(cost: CostModel, shape: CallShape) -> bool:
    """Whether a step of `shape` joining a call saves at least half its own single call: then
    the call's steps end sooner on average batched than one by one, whatever is queued."""
    return 2 * cost.batch_saving_ms >= cost.shape_ms(shape)


def _earliest(a: float | None, b: float | None) -> float | None:
    """The sooner of two deadlines (None: none)."""
    if a is None:
        return b
    return a if b is None else min(a, b)
