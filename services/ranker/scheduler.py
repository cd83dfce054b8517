"""Ranking-first compute scheduler: one worker runs jobs step by step, rank work first."""

import threading
import time
from collections import deque
from collections.abc import Callable, Generator
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
    """A unit of compute split into steps (a generator: each `next` is one chunk of work)."""

    name: str
    steps: Steps
    priority: Priority
    deadline: float | None
    future: Future[Any] = field(default_factory=Future)
    steps_run: int = 0
    # Wall-clock times (time.time_ns) for tracing only; the injected clock governs deadlines.
    submitted_ns: int = field(default_factory=time.time_ns)
    started_ns: int = 0  # its first step began (0: not yet, or never ran)
    finished_ns: int = 0  # its last step ended, or it failed


@dataclass(frozen=True, slots=True)
class Event:
    """One scheduler event, in order: submitted, promoted, step, done, failed, expired,
    cancelled or shed."""

    seq: int
    kind: str
    job: str
    priority: Priority


class ComputeScheduler:
    """Runs compute jobs on one worker thread, one step at a time.

    Between any two steps the worker takes the oldest rank-priority job if there is one, so a
    rank waits at most for the step already running (one prefill chunk), never for a whole
    background job. Jobs of one priority run first-in first-out; a started job is resumed before
    younger jobs of its priority. `promote` lifts a job to rank priority (a Rank waiting on a
    background prefill must not wait behind other ranks' starvation of it). A job whose
    deadline passed before its first step fails with DeadlineExceeded without running; a job
    whose future was cancelled before its first step is dropped. Queues are bounded: `submit`
    raises ResourceExhausted beyond `max_queued[priority]`.
    """

    def __init__(
        self,
        max_queued: dict[Priority, int],
        clock: Callable[[], float] = time.monotonic,
        event_log: int = 4096,
    ) -> None:
        self._queues: dict[Priority, deque[Job]] = {p: deque() for p in Priority}
        self._max_queued = max_queued
        self._clock = clock
        self._cond = threading.Condition()
        self._stopping = False
        self._seq = 0
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
        self, name: str, steps: Steps, priority: Priority, deadline: float | None = None
    ) -> Job:
        job = Job(name, steps, priority, deadline)
        with self._cond:
            if self._stopping:
                raise ResourceExhausted("ranker is shutting down")
            queue = self._queues[priority]
            if len(queue) >= self._max_queued[priority]:
                self._log("shed", job)
                raise ResourceExhausted(
                    f"ranker overloaded: {len(queue)} {priority.name.lower()} jobs queued"
                )
            queue.append(job)
            self._log("submitted", job)
            self._cond.notify()
        return job

    def promote(self, job: Job, deadline: float | None = None) -> None:
        """Run `job` at rank priority, keeping it alive until `deadline` (None: no deadline)."""
        with self._cond:
            if job.deadline is not None:
                job.deadline = None if deadline is None else max(job.deadline, deadline)
            if job.priority is Priority.RANK:
                return
            queue = self._queues[job.priority]
            job.priority = Priority.RANK
            if job in queue:
                queue.remove(job)
                self._queues[Priority.RANK].append(job)
            self._log("promoted", job)

    def depth(self, priority: Priority) -> int:
        with self._cond:
            return len(self._queues[priority])

    # -- worker ----------------------------------------------------------------------------

    def _log(self, kind: str, job: Job) -> None:
        self._seq += 1
        self.events.append(Event(self._seq, kind, job.name, job.priority))

    def _next(self) -> Job | None:
        with self._cond:
            while not any(self._queues.values()):
                if self._stopping:
                    return None
                self._cond.wait()
            for priority in Priority:
                if self._queues[priority]:
                    job = self._queues[priority].popleft()
                    self._log("step", job)
                    return job
        return None

    def _run(self) -> None:
        while (job := self._next()) is not None:
            if job.steps_run == 0 and not self._begin(job):
                continue
            try:
                next(job.steps)
            except StopIteration as done:
                job.finished_ns = time.time_ns()
                job.future.set_result(done.value)
                with self._cond:
                    self._log("done", job)
                continue
            except Exception as err:  # delivered to the waiter, which maps it to a status
                job.finished_ns = time.time_ns()
                job.future.set_exception(err)
                with self._cond:
                    self._log("failed", job)
                continue
            job.steps_run += 1
            with self._cond:  # resume before younger jobs of the same priority
                self._queues[job.priority].appendleft(job)

    def _begin(self, job: Job) -> bool:
        """Whether a job about to take its first step should run at all."""
        if not job.future.set_running_or_notify_cancel():
            outcome = "cancelled"
        elif job.deadline is not None and self._clock() > job.deadline:
            job.future.set_exception(DeadlineExceeded(f"{job.name}: deadline passed while queued"))
            outcome = "expired"
        else:
            job.started_ns = time.time_ns()
            return True
        with self._cond:
            self._log(outcome, job)
        return False
