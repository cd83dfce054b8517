"""The engine's observer over OpenTelemetry: its spans, their attributes and the relay links."""

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass

from opentelemetry.trace import SpanContext, Tracer

from relaygr.behaviours import Prefix, RankInput
from relaygr.cost import CallShape
from relaygr.tracing import (
    Attributes,
    annotate,
    child_span,
    link_current,
    record_linked_span,
    record_span,
    recording,
    sampled_span_context,
    span_context_of,
    traceparent,
)
from services.ranker.core_types import ScoringCall
from services.ranker.observer import (
    ComputeSink,
    EngineObserver,
    NoopObserver,
    Operation,
    Origin,
    TimingObserver,
    Work,
)
from services.ranker.outcomes import CacheOutcome, FetchResult, PreInferOutcome
from services.ranker.prefix_kv import PrefixKV
from services.ranker.queues import Job


@dataclass(frozen=True, slots=True)
class SpanOrigin:
    """The origin this observer makes: the span of the producing request, for a Rank to link."""

    span_context: SpanContext
    operation: Operation


def origin_from_traceparent(text: str) -> Origin | None:
    """The origin a prefix received from a peer keeps, so that a later Rank still links to the
    request that produced it; None for an empty or malformed traceparent."""
    span_context = span_context_of(text)
    return None if span_context is None else Origin(SpanOrigin(span_context, Operation.PEER))


def engine_observer(tracer: Tracer | None, timings: ComputeSink | None = None) -> EngineObserver:
    """The observer for a service's tracer: spans with one, nothing at all without (None); and
    compute timings passed to `timings` either way (None: not kept)."""
    if tracer is not None:
        return TracingObserver(tracer, timings)
    return NoopObserver() if timings is None else TimingObserver(timings)


def origin_traceparent(origin: Origin | None) -> str:
    """The W3C traceparent of the request an entry's origin names, for a peer fetching it
    ("" when it names none this observer made)."""
    return traceparent(origin.span_context) if isinstance(origin, SpanOrigin) else ""


class TracingObserver:
    """Spans under the current (sampled) request span; nothing for an unsampled request.

    A job's queue wait is a `ranker.queue` span and its compute a `ranker.<work>` span, both
    timed by the compute worker. A Rank links to the span whose prefix cache it consumed, and
    carries the size of the model call that scored it (`relaygr.batch.*`).
    """

    def __init__(self, tracer: Tracer, timings: ComputeSink | None = None) -> None:
        self._tracer = tracer
        self._timings = timings

    def computed(
        self, work: Work, tokens: int, cached_tokens: int | None, candidates: int, seconds: float
    ) -> None:
        if self._timings is not None:
            self._timings.computed(work, tokens, cached_tokens, candidates, seconds)

    def batch_computed(self, work: Work, shapes: tuple[CallShape, ...], seconds: float) -> None:
        if self._timings is not None:
            self._timings.batch_computed(work, shapes, seconds)

    def origin(self, operation: Operation) -> Origin | None:
        span_context = sampled_span_context()
        return None if span_context is None else Origin(SpanOrigin(span_context, operation))

    def waiting_inflight(self) -> AbstractContextManager[object]:
        return child_span(self._tracer, "ranker.wait_inflight")

    def ranked(self, job: Job, work: Work, call: ScoringCall | None) -> None:
        # The call a Rank ran in, on its compute span and on the Rank's own span (the one a
        # trace search finds): 1 request when it ran alone.
        if call is None:
            self._record_job(job, work)
            return
        attributes: Attributes = {
            "relaygr.batch.requests": call.requests,
            "relaygr.batch.rows": call.rows,
        }
        annotate(attributes)
        self._record_job(job, work, attributes)

    def prefix_landed(self, job: Job, work: Work, computed_tokens: int, kv: PrefixKV) -> None:
        if not recording(self._tracer):
            return
        attributes: Attributes = {
            "relaygr.tokens.computed": computed_tokens,
            "relaygr.tokens.prefix": kv.num_tokens,
            "relaygr.kv.bytes": kv.nbytes,
            "relaygr.job.chunks": max(job.steps_run, 1),
        }
        if work is Work.RELOAD:
            attributes = {**attributes, "relaygr.kv.from": "dram", "relaygr.kv.to": "hbm"}
        self._record_job(job, work, attributes)

    def prefix_failed(self, job: Job, work: Work) -> None:
        self._record_job(job, work, {"error": True})

    def pre_infer_served(
        self, prefix: Prefix, outcome: PreInferOutcome, kv: PrefixKV, window_s: float
    ) -> None:
        if sampled_span_context() is None:
            return
        annotate(
            {
                "relaygr.user_id": prefix.user_id,
                "relaygr.pre_infer.outcome": outcome.value,
                "relaygr.tokens.prefix": kv.num_tokens,
                "relaygr.kv.bytes": kv.nbytes,
                "relaygr.relay.window_ms": window_s * 1e3,
            }
        )

    def rank_served(
        self,
        request: RankInput,
        outcome: CacheOutcome,
        computed_tokens: int,
        consumed: Origin | None,
    ) -> None:
        if not recording(self._tracer):
            return
        annotate(
            {
                "relaygr.user_id": request.prefix.user_id,
                "relaygr.cache.outcome": outcome.value,
                "relaygr.tokens.prefix": request.prefix.num_tokens,
                "relaygr.tokens.computed": computed_tokens,
                "relaygr.candidates": len(request.candidates),
            }
        )
        if isinstance(consumed, SpanOrigin):
            link_current(
                consumed.span_context,
                {"relaygr.link": "relay", "relaygr.relay.producer": consumed.operation.value},
            )

    def remote_origin(self, traceparent: str) -> Origin | None:
        return origin_from_traceparent(traceparent)

    def fetched(
        self,
        peer: str,
        result: FetchResult,
        nbytes: int,
        seconds: float,
        start_ns: int,
        producer: Origin | None,
    ) -> None:
        # One span per peer asked, linked to the request that produced what it brought.
        attributes: Attributes = {
            "relaygr.fetch.peer": peer,
            "relaygr.fetch.result": result.value,
            "relaygr.kv.bytes": nbytes,
            "relaygr.kv.from": "peer",
            "relaygr.kv.to": "hbm",
        }
        if result not in (FetchResult.HIT, FetchResult.NOT_FOUND):  # not found: expected
            attributes = {**attributes, "error": True}
        link = producer.span_context if isinstance(producer, SpanOrigin) else None
        record_linked_span(
            self._tracer,
            "ranker.fetch",
            start_ns,
            start_ns + int(seconds * 1e9),
            attributes,
            link,
            {"relaygr.link": "fetched_from"},
        )

    def demoting(self, kv: PrefixKV) -> AbstractContextManager[object]:
        # A tier move (HBM eviction keeping a host copy), traced under the request causing it.
        attributes: Attributes = {
            "relaygr.kv.bytes": kv.nbytes,
            "relaygr.tokens.prefix": kv.num_tokens,
            "relaygr.kv.to": "dram",
        }
        return child_span(self._tracer, "ranker.demote", attributes)

    def _record_job(self, job: Job, work: Work, attributes: Attributes | None = None) -> None:
        """Spans for a job's wait in the queue and its compute, timed by the worker."""
        if not recording(self._tracer):
            return
        now = time.time_ns()
        queue_attributes: Attributes = {
            "relaygr.job": job.name,
            "relaygr.priority": job.priority.name.lower(),
        }
        record_span(
            self._tracer, "ranker.queue", job.submitted_ns, job.started_ns or now, queue_attributes
        )
        if job.started_ns:
            record_span(
                self._tracer, f"ranker.{work}", job.started_ns, job.finished_ns or now, attributes
            )
