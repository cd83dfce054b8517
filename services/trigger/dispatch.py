"""Sends admitted PreInfers through the router in the background: bounded, deadlined, counted."""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry.context import Context

from relaygr.aio import cancel_and_wait
from relaygr.tracing import attached
from relaygr.v1 import common_pb2, trigger_pb2
from services.trigger.policy import Decision

_log = logging.getLogger("services.trigger")


@dataclass(frozen=True, slots=True)
class Job:
    """An admitted relay: the event it came from; its PreInfer is built by the worker that sends
    it, off the decision path (copying an 8k history into a new message takes ~0.5 ms)."""

    decision: Decision
    event: trigger_pb2.RetrievalEvent
    timeout_ms: int  # how long its PreInfer may take: the trigger's longest relay window
    # The deciding request's trace context: the PreInfer is sent in it, so the relay's trace
    # continues from the decision (None: tracing off).
    trace_context: Context | None = None
    preferred_instance: str = ""  # where the trigger found room ("": the router's own order)
    rank_due_at: float | None = None  # when the Rank is expected, on the dispatcher's clock

    @property
    def user_id(self) -> str:
        return self.event.user_id

    def pre_infer(self, now: float) -> common_pb2.PreInferRequest:
        """The PreInfer as sent at `now`: the Rank is expected the rest of the gap later (at
        least 1 ms: 0 would mean no expectation)."""
        e = self.event
        due_in_ms = 0 if self.rank_due_at is None else max(1, round((self.rank_due_at - now) * 1e3))
        request = common_pb2.PreInferRequest(
            request_id=e.request_id,
            user_id=e.user_id,
            relay_window_ms=self.decision.relay_window_ms,
            request_ts=e.request_ts,
            rank_expected_in_ms=due_in_ms,
            preferred_instance=self.preferred_instance,
            # The version admission judged: the router sends it to that version's rankers only.
            model_version=self.decision.model_version,
        )
        request.user_features.extend(e.user_features)
        request.long_term.CopyFrom(e.long_term)
        return request


Send = Callable[[common_pb2.PreInferRequest, float], Awaitable[common_pb2.PreInferReply]]
# (job, reply, None) on success, (job, None, failure status) otherwise; once per job.
Outcome = Callable[[Job, common_pb2.PreInferReply | None, "Failure | None"], None]


@dataclass(frozen=True, slots=True)
class Failure:
    code: grpc.StatusCode
    details: str


@dataclass(slots=True)
class DispatchStats:
    """What the dispatcher's workers saw end: `failed` jobs by the status they failed with, and
    jobs `cancelled` at shutdown (still queued or in flight). Successes are the outcome
    handler's to count (the trigger's `stats.relayed`)."""

    failed: Counter[grpc.StatusCode] = field(default_factory=Counter)
    cancelled: int = 0


class Dispatcher:
    """A bounded queue of admitted PreInfers and `concurrency` workers sending them.

    Invariants: at most `capacity` jobs wait and `concurrency` are in flight, so memory and
    tasks stay bounded whatever the event rate; `submit` never blocks and answers False when the
    queue is full (the caller counts the drop). Every job submitted reaches `on_outcome` exactly
    once, with the reply or the failure (deadline included), unless `stop` cancels it;
    `stats` tallies failures by status and cancellations.
    """

    def __init__(
        self,
        send: Send,
        capacity: int,
        concurrency: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the one jobs' `rank_due_at` is on."""
        self._send = send
        self._clock = clock
        self._on_outcome: Outcome = lambda *_: None
        self._queue: asyncio.Queue[Job] = asyncio.Queue(maxsize=capacity)
        self._concurrency = concurrency
        self._workers: list[asyncio.Task[None]] = []
        self._in_flight = 0
        self.stats = DispatchStats()

    def start(self, on_outcome: Outcome) -> None:
        self._on_outcome = on_outcome
        self._workers = [
            asyncio.create_task(self._work(), name=f"trigger-dispatch-{i}")
            for i in range(self._concurrency)
        ]

    def submit(self, job: Job) -> bool:
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            return False
        return True

    def pending(self) -> int:
        """Jobs waiting or in flight."""
        return self._queue.qsize() + self._in_flight

    def queued(self) -> int:
        """Jobs waiting for a worker."""
        return self._queue.qsize()

    def in_flight(self) -> int:
        """Jobs being sent."""
        return self._in_flight

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every submitted job to finish; True if they did."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Cancel the workers; jobs still queued or in flight are counted as cancelled."""
        workers, self._workers = self._workers, []
        await cancel_and_wait(*workers)
        self.stats.cancelled += self._queue.qsize()

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            self._in_flight += 1
            try:
                with attached(job.trace_context):
                    reply = await self._send(job.pre_infer(self._clock()), job.timeout_ms / 1e3)
            except asyncio.CancelledError:
                self.stats.cancelled += 1
                raise
            except grpc.aio.AioRpcError as err:
                self._fail(job, Failure(err.code(), err.details() or ""))
            except Exception as err:  # e.g. the channel closed under the call
                _log.warning("dispatch to the router failed for %s: %r", job.user_id, err)
                self._fail(job, Failure(grpc.StatusCode.UNKNOWN, repr(err)))
            else:
                self._report(job, reply, None)
            finally:
                self._in_flight -= 1
                self._queue.task_done()

    def _fail(self, job: Job, failure: Failure) -> None:
        self.stats.failed[failure.code] += 1
        self._report(job, None, failure)

    def _report(
        self,
        job: Job,
        reply: common_pb2.PreInferReply | None,
        failure: Failure | None,
    ) -> None:
        try:
            self._on_outcome(job, reply, failure)
        except Exception:  # a bookkeeping bug must not kill the worker
            _log.exception("dispatch outcome handler failed for user %s", job.user_id)
