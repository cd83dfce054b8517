"""Ranking-first compute scheduler: one worker runs jobs step by step, rank work first, background
work earliest deadline first."""

import heapq
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from relaygr.errors import DeadlineExceeded, ResourceExhausted

Steps = Generator[None, None, Any]


class Priority(IntEnum):
    RANK = 0
    BACKGROUND = 1


@dataclass(eq=False, slots=True)
class Job:
    """A unit of compute split into steps (a generator: each `next` is one chunk of work).

    `deadline` is when its caller gives up (a job not started by then never runs); `due` is
    when its result is wanted (a PreInfer's Rank), the order of background work and nothing
    else. `step_ms` predicts each step's compute time; `remaining_ms` is the part of it not yet
    run (steps past the prediction count 0).
    """

    name: str
    steps: Steps
    priority: Priority
    deadline: float | None
    due: float | None = None
    step_ms: tuple[float, ...] = ()
    remaining_ms: float = 0.0
    future: Future[Any] = field(default_factory=Future)
    steps_run: int = 0
    seq: int = 0  # submission order: ties of `due` go to the older job
    queued: bool = False  # in a queue (False: on the worker, or finished)
    counted: bool = False  # its remaining_ms is in the scheduler's total for its priority
    # Wall-clock times (time.time_ns) for tracing only; the injected clock governs deadlines.
    submitted_ns: int = field(default_factory=time.time_ns)
    started_ns: int = 0  # its first step began (0: not yet, or never ran)
    finished_ns: int = 0  # its last step ended, or it failed

    @property
    def next_step_ms(self) -> float:
        """The predicted time of the step it runs next (0 past the prediction)."""
        return self.step_ms[self.steps_run] if self.steps_run < len(self.step_ms) else 0.0


@dataclass(frozen=True, slots=True)
class Event:
    """One scheduler event, in order: submitted, promoted, restarted, step, done, failed,
    expired, cancelled or shed; `at` is the injected clock's time."""

    seq: int
    kind: str
    job: str
    priority: Priority
    at: float


def run_step(job: Job) -> None:
    """The worker's executor: run `job`'s next step on this thread (StopIteration: it is done)."""
    next(job.steps)


class ComputeScheduler:
    """Runs compute jobs on one worker thread, one step at a time.

    Between any two steps the worker takes the oldest rank-priority job if there is one, so a
    rank waits at most for the step already running (one prefill chunk), never for a whole
    background job. Rank jobs run first-in first-out, a started one resumed before younger ones.
    Background jobs run earliest `due` first (no `due`: after every dated job), ties in
    submission order; a background job goes back to that order after each step, so one due
    sooner that arrived meanwhile overtakes it between chunks (preemptive EDF: a long prefill
    whose Rank is far off never holds up a short one whose Rank is near). `promote` lifts a job
    to rank priority (a Rank waiting on a background prefill must not wait behind other
    background work); `restart` replaces a queued job's remaining steps. A job whose deadline
    passed before its first step fails with DeadlineExceeded without running; a job whose
    future was cancelled before its first step is dropped. Queues are bounded: `submit` raises
    ResourceExhausted beyond `max_queued[priority]`. `queued_background_ms` and
    `queued_rank_ms` are the predicted compute time of the jobs of that priority queued or
    running: running totals, updated as jobs are submitted, promoted, restarted and step, 0
    exactly whenever there are none.
    """

    def __init__(
        self,
        max_queued: dict[Priority, int],
        clock: Callable[[], float] = time.monotonic,
        event_log: int = 4096,
        executor: Callable[[Job], None] = run_step,
    ) -> None:
        """`executor` runs one step of a job on the worker (tests advance a virtual clock)."""
        self._ranks: deque[Job] = deque()
        # (due, seq, job) entries; a promoted job's entry stays behind, skipped when popped.
        self._background: list[tuple[float, int, Job]] = []
        self._background_queued = 0  # live entries of _background
        # Per priority, the predicted remaining compute of its jobs, and how many are counted.
        self._queued_ms = {p: 0.0 for p in Priority}
        self._counted = {p: 0 for p in Priority}
        self._max_queued = max_queued
        self.clock = clock
        self._executor = executor
        self._cond = threading.Condition()
        self._stopping = False
        self._seq = 0
        self._submitted = 0
        self.events: deque[Event] = deque(maxlen=event_log)
        self._thread = threading.Thread(target=self._run, name="relaygr-compute", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish every queued job, then end the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def submit(
        self,
        name: str,
        steps: Steps,
        priority: Priority,
        deadline: float | None = None,
        *,
        due: float | None = None,
        step_ms: Sequence[float] = (),
    ) -> Job:
        """Queue a job; `due` orders background work, `step_ms` predicts each step's time."""
        costs = tuple(step_ms)
        job = Job(name, steps, priority, deadline, due, costs, sum(costs))
        with self._cond:
            if self._stopping:
                raise ResourceExhausted("ranker is shutting down")
            queued = self._depth(priority)
            if queued >= self._max_queued[priority]:
                self._log("shed", job)
                raise ResourceExhausted(
                    f"ranker overloaded: {queued} {priority.name.lower()} jobs queued"
                )
            self._submitted += 1
            job.seq = self._submitted
            self._count(job)
            self._enqueue(job, resume=False)
            self._log("submitted", job)
            self._cond.notify()
        return job

    def promote(self, job: Job, deadline: float | None = None) -> None:
        """Run `job` at rank priority, keeping it alive until `deadline` (None: no deadline)."""
        with self._cond:
            self._promote(job, deadline)

    def restart(
        self, job: Job, steps: Steps, step_ms: Sequence[float], deadline: float | None = None
    ) -> bool:
        """Replace the steps of `job`, which sits in a queue, and run them at rank priority as
        `promote` does; False (nothing changed) when it is on the worker or finished. Its
        earlier steps' partial work is dropped; its future and first-step checks stay."""
        with self._cond:
            if not job.queued or job.future.done():
                return False
            self._promote(job, deadline)
            old, job.steps = job.steps, steps
            self._uncount(job)
            job.step_ms, job.steps_run = tuple(step_ms), 0
            job.remaining_ms = sum(job.step_ms)
            self._count(job)
            self._log("restarted", job)
        old.close()  # not running: no step of it can be in progress
        return True

    def depth(self, priority: Priority) -> int:
        """Jobs of `priority` waiting in its queue (the one on the worker not counted)."""
        with self._cond:
            return self._depth(priority)

    def _depth(self, priority: Priority) -> int:
        return len(self._ranks) if priority == Priority.RANK else self._background_queued

    def queued_background_ms(self) -> float:
        """Predicted compute time of background-priority work queued or running (O(1))."""
        with self._cond:
            return self._queued_ms[Priority.BACKGROUND]

    def queued_rank_ms(self) -> float:
        """Predicted compute time of rank-priority work queued or running (O(1)): how long a
        new Rank would wait before its own compute starts."""
        with self._cond:
            return self._queued_ms[Priority.RANK]

    # -- bookkeeping (under the lock) ------------------------------------------------------

    def _log(self, kind: str, job: Job) -> None:
        self._seq += 1
        self.events.append(Event(self._seq, kind, job.name, job.priority, self.clock()))

    def _enqueue(self, job: Job, resume: bool) -> None:
        """Queue `job`; `resume`: it just ran a step (a rank job then goes first)."""
        job.queued = True
        if job.priority is Priority.RANK:
            if resume:
                self._ranks.appendleft(job)
            else:
                self._ranks.append(job)
        else:
            due = math.inf if job.due is None else job.due
            heapq.heappush(self._background, (due, job.seq, job))
            self._background_queued += 1

    def _promote(self, job: Job, deadline: float | None) -> None:
        if job.deadline is not None:
            job.deadline = None if deadline is None else max(job.deadline, deadline)
        if job.priority is Priority.RANK:
            return
        self._uncount(job)
        job.priority = Priority.RANK
        self._count(job)
        if job.queued:  # its heap entry is now stale: skipped when it comes up
            self._background_queued -= 1
            self._ranks.append(job)
        self._log("promoted", job)

    def _count(self, job: Job) -> None:
        job.counted = True
        self._counted[job.priority] += 1
        self._queued_ms[job.priority] += job.remaining_ms

    def _uncount(self, job: Job) -> None:
        if not job.counted:
            return
        job.counted = False
        self._counted[job.priority] -= 1
        # Exactly 0 when none is left: no rounding residue from the steps' subtractions.
        left = self._queued_ms[job.priority] - job.remaining_ms
        self._queued_ms[job.priority] = left if self._counted[job.priority] else 0.0

    def _ran_step(self, job: Job, ms: float) -> None:
        job.steps_run += 1
        job.remaining_ms -= ms
        if job.counted:
            self._queued_ms[job.priority] -= ms

    def _take(self) -> Job | None:
        if self._ranks:
            return self._ranks.popleft()
        while self._background:
            _, _, job = heapq.heappop(self._background)
            if job.priority is Priority.BACKGROUND:  # else promoted: a stale entry
                self._background_queued -= 1
                return job
        return None

    # -- stepping --------------------------------------------------------------------------

    def take(self) -> Job | None:
        """The next job to step, without waiting; None when every queue is empty.

        What the worker thread does between steps, for a caller that runs the steps itself (a
        simulator on a virtual clock, which then calls `step`). A job due its first step that
        must not run (deadline passed, future cancelled) is settled here and skipped.
        """
        while True:
            with self._cond:
                job = self._take()
                if job is None:
                    return None
                self._taken(job)
            if job.started_ns == 0 and not self._begin(job):
                continue
            return job

    def step(self, job: Job) -> bool:
        """Run `job`'s next step (through the executor) and book it: True when the job ended
        (its future holds the result or the error), False when it went back to its queue."""
        ms = job.next_step_ms
        try:
            self._executor(job)
        # The books close before the waiter hears: what it reads next (the event log, the
        # queued total) already counts this job as finished.
        except StopIteration as done:
            job.finished_ns = time.time_ns()
            self._end(job, "done")
            job.future.set_result(done.value)
            return True
        except Exception as err:  # delivered to the waiter, which maps it to a status
            job.finished_ns = time.time_ns()
            self._end(job, "failed")
            job.future.set_exception(err)
            return True
        with self._cond:
            self._ran_step(job, ms)
            self._enqueue(job, resume=True)
        return False

    # -- worker ----------------------------------------------------------------------------

    def _taken(self, job: Job) -> None:
        job.queued = False
        self._log("step", job)

    def _next(self) -> Job | None:
        with self._cond:
            while (job := self._take()) is None:
                if self._stopping:
                    return None
                self._cond.wait()
            self._taken(job)
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            if job.started_ns == 0 and not self._begin(job):
                continue
            self.step(job)

    def _end(self, job: Job, outcome: str) -> None:
        with self._cond:
            self._uncount(job)
            self._log(outcome, job)

    def _begin(self, job: Job) -> bool:
        """Whether a job about to take its first step should run at all."""
        if not job.future.set_running_or_notify_cancel():
            outcome = "cancelled"
        elif job.deadline is not None and self.clock() > job.deadline:
            self._end(job, "expired")
            job.future.set_exception(DeadlineExceeded(f"{job.name}: deadline passed while queued"))
            return False
        else:
            job.started_ns = time.time_ns()
            return True
        self._end(job, outcome)
        return False
