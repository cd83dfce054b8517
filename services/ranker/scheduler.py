"""A compute worker thread over the ranking-first queues (`queues.ComputeQueues`): each job a
generator whose `next` is one step, its result delivered through a future."""

import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from relaygr.errors import DeadlineExceeded, ResourceExhausted
from services.ranker.queues import ComputeQueues, Event, Overloaded, Priority
from services.ranker.queues import Job as QueuedJob

__all__ = ["ComputeScheduler", "Event", "Job", "Priority", "Steps", "run_step"]

Steps = Generator[None, None, Any]


@dataclass(eq=False, slots=True)
class Job(QueuedJob):
    """A queued job whose spec is its steps (a generator), its outcome a future."""

    future: Future[Any] = field(default_factory=Future)

    @property
    def steps(self) -> Steps:
        steps: Steps = self.spec
        return steps


def run_step(job: Job) -> None:
    """The worker's executor: run `job`'s next step on this thread (StopIteration: it is done)."""
    next(job.steps)


class ComputeScheduler:
    """Runs generator jobs on one worker thread, one step at a time, in the order of
    `ComputeQueues` (which see). A job whose deadline passed before its first step fails with
    DeadlineExceeded without running; a job whose future was cancelled before its first step is
    dropped; a full queue refuses with ResourceExhausted."""

    def __init__(
        self,
        max_queued: dict[Priority, int],
        clock: Callable[[], float] = time.monotonic,
        event_log: int = 4096,
        executor: Callable[[Job], None] = run_step,
    ) -> None:
        """`executor` runs one step of a job on the worker (tests advance a virtual clock)."""
        self._queues = ComputeQueues(max_queued, clock, event_log)
        self.clock = clock
        self.events = self._queues.events
        self._executor = executor
        self._cond = threading.Condition()
        self._stopping = False
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
        job.submitted_ns = time.time_ns()
        with self._cond:
            if self._stopping:
                raise ResourceExhausted("ranker is shutting down")
            try:
                self._queues.add(job)
            except Overloaded as err:
                raise ResourceExhausted(str(err)) from err
            self._cond.notify()
        return job

    def promote(self, job: Job, deadline: float | None = None) -> None:
        with self._cond:
            self._queues.promote(job, deadline)

    def restart(
        self, job: Job, steps: Steps, step_ms: Sequence[float], deadline: float | None = None
    ) -> bool:
        with self._cond:
            if job.future.done():
                return False
            old = job.steps
            if not self._queues.restart(job, steps, step_ms, deadline):
                return False
        old.close()  # not running: no step of it can be in progress
        return True

    def depth(self, priority: Priority) -> int:
        with self._cond:
            return self._queues.depth(priority)

    def queued_background_ms(self) -> float:
        with self._cond:
            return self._queues.queued_background_ms()

    def queued_rank_ms(self) -> float:
        with self._cond:
            return self._queues.queued_rank_ms()

    # -- stepping --------------------------------------------------------------------------

    def take(self) -> Job | None:
        """The next job to step, without waiting; None when every queue is empty."""
        with self._cond:
            job, dropped = self._queues.take(_may_start)
        self._settle(dropped)
        return job  # type: ignore[return-value]

    def step(self, job: Job) -> bool:
        """Run `job`'s next step (through the executor) and book it: True when the job ended
        (its future holds the result or the error), False when it went back to its queue."""
        if not job.started_ns:
            job.started_ns = time.time_ns()
        ms = job.next_step_ms
        try:
            self._executor(job)
        # The books close before the waiter hears: what it reads next (the event log, the
        # queued total) already counts this job as finished.
        except StopIteration as done:
            job.finished_ns = time.time_ns()
            with self._cond:
                self._queues.end(job, "done")
            job.future.set_result(done.value)
            return True
        except Exception as err:  # delivered to the waiter, which maps it to a status
            job.finished_ns = time.time_ns()
            with self._cond:
                self._queues.end(job, "failed")
            job.future.set_exception(err)
            return True
        with self._cond:
            self._queues.stepped(job, ms)
        return False

    def _settle(self, dropped: list[QueuedJob]) -> None:
        for job in dropped:
            assert isinstance(job, Job)
            if not job.cancelled:
                job.future.set_exception(
                    DeadlineExceeded(f"{job.name}: deadline passed while queued")
                )

    def _next(self) -> Job | None:
        while True:
            with self._cond:
                while True:
                    job, dropped = self._queues.take(_may_start)
                    if job is not None or dropped or self._stopping:
                        break
                    self._cond.wait()
            self._settle(dropped)
            if job is not None or not dropped:
                return job  # type: ignore[return-value]

    def _run(self) -> None:
        while (job := self._next()) is not None:
            self.step(job)


def _may_start(job: QueuedJob) -> bool:
    assert isinstance(job, Job)
    return job.future.set_running_or_notify_cancel()
