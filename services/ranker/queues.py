"""Ranking-first compute queues: which job's step runs next. Synchronous, no lock, no thread.

The ranker core (services/ranker/core.py) owns one and its drivers run the steps it takes.
"""

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any


class Priority(IntEnum):
    RANK = 0
    BACKGROUND = 1


@dataclass(eq=False, slots=True)
class Job:
    """A unit of compute split into steps; `spec` says what to compute (data for the driver that
    runs it: the queues never look inside).

    `deadline` is when its caller gives up (a job not started by then never runs); `due` is
    when its result is wanted (a PreInfer's Rank), the order of background work and nothing
    else. `step_ms` predicts each step's compute time; `remaining_ms` is the part of it not yet
    run (steps past the prediction count 0). `partial` is what its steps so far produced
    (opaque: the driver hands it back with the next step's result).
    """

    name: str
    spec: Any
    priority: Priority
    deadline: float | None
    due: float | None = None
    step_ms: tuple[float, ...] = ()
    remaining_ms: float = 0.0
    steps_run: int = 0
    seq: int = 0  # submission order: ties of `due` (or of `place`) go to the older job
    # A rank job's place in line: when the Rank it serves arrived (its submission, for one
    # serving no Rank). A Rank's prefill and its scoring share the Rank's place, so a miss
    # keeps its place between the two (docs/architecture.md §7).
    place: float = 0.0
    queued: bool = False  # in a queue (False: taken, or finished)
    counted: Priority | None = None  # the priority whose total holds its remaining_ms
    started: bool = False  # its first step was taken
    cancelled: bool = False  # its caller left before it started: never run
    solo: bool = False  # the batched call it ran in failed: it runs alone from now on
    batched: bool = False  # a step of it ran in a batched call: `seconds` are not its own alone
    partial: Any = None
    tag: Any = None  # the driver's, for the request that caused it (opaque here)
    seconds: float = 0.0  # compute time of its steps so far, as the driver measured it
    # Wall-clock times (ns) for tracing only; the injected clock governs deadlines.
    submitted_ns: int = 0
    started_ns: int = 0  # its first step began (0: not yet, or never ran)
    finished_ns: int = 0  # its last step ended, or it failed

    @property
    def next_step_ms(self) -> float:
        """The predicted time of the step it runs next (0 past the prediction)."""
        return self.step_ms[self.steps_run] if self.steps_run < len(self.step_ms) else 0.0


@dataclass(frozen=True, slots=True)
class Event:
    """One queue event, in order: submitted, promoted, restarted, step, done, failed, expired,
    cancelled or shed; `at` is the injected clock's time."""

    seq: int
    kind: str
    job: str
    priority: Priority
    at: float


class Overloaded(Exception):
    """A queue is full: `submit` refused the job (the message says which queue)."""


class ComputeQueues:
    """The order in which one worker runs jobs, one step at a time.

    Between any two calls the worker takes a rank-priority job if there is one, so a rank waits
    at most for the call already running (one prefill chunk, or one call of several users'
    chunks), never for a whole background job.
    Rank jobs run in the order their Ranks arrived (`Job.place`, ties in submission order), a
    started one resumed first: a miss's scoring, queued when its prefill lands, goes before
    every Rank that arrived after it.
    Background jobs run earliest `due` first (no `due`: after every dated job), ties in
    submission order; a background job goes back to that order after each step, so one due
    sooner that arrived meanwhile overtakes it between chunks (preemptive EDF). `promote` lifts a
    job to rank priority; `restart` replaces a queued job's remaining steps; `take_more` takes
    the jobs right behind the one taken, from its queue only, for one batched call. Queues are
    bounded: `submit` raises Overloaded beyond `max_queued[priority]`. `queued_background_ms` and
    `queued_rank_ms` are the predicted compute time of the jobs of each priority queued or
    running: running totals, updated as steps complete and jobs are promoted or restarted, 0
    exactly whenever there are none.
    """

    def __init__(
        self, max_queued: dict[Priority, int], clock: Callable[[], float], event_log: int = 4096
    ) -> None:
        # (not started, place, seq, job): a started rank job resumes first, then by place.
        self._ranks: list[tuple[bool, float, int, Job]] = []
        # (due, seq, job) entries; a promoted job's entry stays behind, skipped when popped.
        self._background: list[tuple[float, int, Job]] = []
        self._background_queued = 0  # live entries of _background
        self._ms = {p: 0.0 for p in Priority}  # remaining_ms of the jobs counted, per priority
        self._counted = {p: 0 for p in Priority}  # jobs counted, per priority
        self._max_queued = max_queued
        self.clock = clock
        self._seq = 0
        self._submitted = 0
        self.events: deque[Event] = deque(maxlen=event_log)

    def submit(
        self,
        name: str,
        spec: Any,
        priority: Priority,
        deadline: float | None = None,
        *,
        due: float | None = None,
        step_ms: Sequence[float] = (),
        submitted_ns: int = 0,
        place: float | None = None,
    ) -> Job:
        """Queue a job; `due` orders background work, `place` rank work (None: now), `step_ms`
        predicts each step's time."""
        costs = tuple(step_ms)
        job = Job(name, spec, priority, deadline, due, costs, sum(costs))
        job.submitted_ns = submitted_ns
        job.place = self.clock() if place is None else place
        return self.add(job)

    def add(self, job: Job) -> Job:
        """Queue a job built by the caller (`submit` builds a plain one)."""
        priority = job.priority
        queued = self.depth(priority)
        if queued >= self._max_queued[priority]:
            self._log("shed", job)
            raise Overloaded(f"ranker overloaded: {queued} {priority.name.lower()} jobs queued")
        self._submitted += 1
        job.seq = self._submitted
        self._count(job)
        self.enqueue(job, resume=False)
        self._log("submitted", job)
        return job

    def promote(self, job: Job, deadline: float | None = None, place: float | None = None) -> None:
        """Run `job` at rank priority, keeping it alive until `deadline` (None: no deadline), in
        the place of the Rank that waits for it (`place`, its arrival; None: now)."""
        if job.deadline is not None:
            job.deadline = None if deadline is None else max(job.deadline, deadline)
        place = self.clock() if place is None else place
        if job.priority is Priority.RANK:
            if place < job.place and job.queued:  # an earlier Rank waits for it: move it up
                self._ranks = [e for e in self._ranks if e[3] is not job]
                heapq.heapify(self._ranks)
                job.place = place
                self._push_rank(job)
            return
        self._uncount(job)
        job.priority = Priority.RANK
        job.place = place
        self._count(job)
        if job.queued:  # its heap entry is now stale: skipped when it comes up
            self._background_queued -= 1
            self._push_rank(job)
        self._log("promoted", job)

    def restart(
        self,
        job: Job,
        spec: Any,
        step_ms: Sequence[float],
        deadline: float | None = None,
        place: float | None = None,
    ) -> bool:
        """Replace what `job`, which sits in a queue, computes, and run it at rank priority as
        `promote` does; False (nothing changed) when it is taken or finished. Its earlier steps'
        partial work is dropped; its first-step checks stay."""
        if not job.queued or job.cancelled:
            return False
        self.promote(job, deadline, place)
        self._uncount(job)
        job.spec, job.partial = spec, None
        job.step_ms, job.steps_run = tuple(step_ms), 0
        job.remaining_ms = sum(job.step_ms)
        self._count(job)
        self._log("restarted", job)
        return True

    def depth(self, priority: Priority) -> int:
        """Jobs of `priority` waiting in its queue (a taken one not counted)."""
        return len(self._ranks) if priority == Priority.RANK else self._background_queued

    def queued_background_ms(self) -> float:
        """Predicted compute time of background-priority work queued or running (O(1))."""
        return self._ms[Priority.BACKGROUND]

    def queued_rank_ms(self) -> float:
        """Predicted compute time of rank-priority work queued or running (O(1)), each job in
        a call of its own: what a Rank arriving now waits behind, before batching."""
        return self._ms[Priority.RANK]

    def queued_rank_jobs(self) -> int:
        """Rank-priority jobs queued or running (O(1))."""
        return self._counted[Priority.RANK]

    def take(
        self, may_start: Callable[[Job], bool] = lambda job: not job.cancelled
    ) -> tuple[Job | None, list[Job]]:
        """The next job to step (None: every queue is empty), and the jobs due their first step
        that must not run, settled on the way: cancelled (`may_start` False) or expired
        (deadline passed)."""
        dropped: list[Job] = []
        while True:
            job = self._pop()
            if job is None:
                return None, dropped
            job.queued = False
            self._log("step", job)
            if job.started or self._starts(job, may_start):
                return job, dropped
            dropped.append(job)

    def take_more(
        self,
        joins: Callable[[Job], bool],
        may_start: Callable[[Job], bool] = lambda job: not job.cancelled,
        priority: Priority = Priority.RANK,
    ) -> tuple[list[Job], list[Job]]:
        """Jobs to run in one call with the job just taken: those next in the queue of
        `priority` (the taken job's), in its order, while `joins` accepts them (the first
        refused stays at the head, so nothing overtakes it). Only that queue is read: background
        work never joins a call of rank work, nor rank work one of background work. A started
        job met on the way joins or stops the call as `joins` says (it resumes its later
        steps); one due its first step that must not start (`take`'s rules) is settled and
        returned as dropped: a cancelled or expired Rank is never in a batch."""
        taken: list[Job] = []
        dropped: list[Job] = []
        while (job := self._head(priority)) is not None:
            may = job.started or (may_start(job) and not self._expired(job))
            if may and not joins(job):
                break
            self._pop_head(priority)
            job.queued = False
            self._log("step", job)
            (taken if job.started or self._starts(job, may_start) else dropped).append(job)
        return taken, dropped

    def _starts(self, job: Job, may_start: Callable[[Job], bool]) -> bool:
        """Whether `job`, taken for its first step, starts; if not, it is settled (cancelled
        or expired)."""
        if not may_start(job):
            job.cancelled = True
            self.end(job, "cancelled")
        elif self._expired(job):
            self.end(job, "expired")
        else:
            job.started = True
            return True
        return False

    def _expired(self, job: Job) -> bool:
        return job.deadline is not None and self.clock() > job.deadline

    def stepped(self, job: Job, ms: float) -> None:
        """`job` ran a step predicted at `ms` and goes on: back to its queue (a rank job
        first)."""
        job.steps_run += 1
        job.remaining_ms -= ms
        if job.counted is not None:
            self._ms[job.counted] -= ms
        self.enqueue(job, resume=True)

    def end(self, job: Job, outcome: str) -> None:
        """`job` is over (done, failed, expired, cancelled): out of the books."""
        self._uncount(job)
        self._log(outcome, job)

    # -- bookkeeping -----------------------------------------------------------------------

    def enqueue(self, job: Job, resume: bool) -> None:
        """Queue `job`; `resume`: it just ran a step (a rank job then goes first)."""
        job.queued = True
        if job.priority is Priority.RANK:
            self._push_rank(job)
        else:
            due = math.inf if job.due is None else job.due
            heapq.heappush(self._background, (due, job.seq, job))
            self._background_queued += 1

    def _push_rank(self, job: Job) -> None:
        heapq.heappush(self._ranks, (not job.started, job.place, job.seq, job))

    def _pop(self) -> Job | None:
        if self._ranks:
            return self._pop_head(Priority.RANK)
        if self._head(Priority.BACKGROUND) is not None:
            return self._pop_head(Priority.BACKGROUND)
        return None

    def _head(self, priority: Priority) -> Job | None:
        """The job at the head of the queue of `priority`, left there (None: it is empty)."""
        if priority is Priority.RANK:
            return self._ranks[0][3] if self._ranks else None
        while self._background:
            job = self._background[0][2]
            if job.priority is Priority.BACKGROUND:
                return job
            heapq.heappop(self._background)  # promoted: a stale entry
        return None

    def _pop_head(self, priority: Priority) -> Job:
        """Take the job `_head(priority)` returned."""
        if priority is Priority.RANK:
            return heapq.heappop(self._ranks)[3]
        self._background_queued -= 1
        return heapq.heappop(self._background)[2]

    def _log(self, kind: str, job: Job) -> None:
        self._seq += 1
        self.events.append(Event(self._seq, kind, job.name, job.priority, self.clock()))

    def _count(self, job: Job) -> None:
        job.counted = job.priority
        self._counted[job.priority] += 1
        self._ms[job.priority] += job.remaining_ms

    def _uncount(self, job: Job) -> None:
        priority = job.counted
        if priority is None:
            return
        job.counted = None
        self._counted[priority] -= 1
        # Exactly 0 when none is left: no rounding residue from the steps' subtractions.
        self._ms[priority] = (
            self._ms[priority] - job.remaining_ms if self._counted[priority] else 0.0
        )
