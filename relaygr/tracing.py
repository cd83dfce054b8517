"""The services' own spans, through the OpenTelemetry API only: free when tracing is off.

Code that traces holds a `Tracer | None`; None (tracing off) makes every helper here a no-op
that allocates nothing. With a tracer, spans are made only inside a sampled request: a span
under an unsampled parent would be dropped by the sampler anyway, so it is not built.
"""

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TypeAlias, TypeGuard

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

Attributes: TypeAlias = Mapping[str, AttributeValue]

_OFF: nullcontext[None] = nullcontext(None)


def recording(tracer: Tracer | None) -> TypeGuard[Tracer]:
    """Whether spans made now would be kept: tracing is on and the current span is sampled."""
    return tracer is not None and trace.get_current_span().is_recording()


def child_span(
    tracer: Tracer | None, name: str, attributes: Attributes | None = None
) -> AbstractContextManager[Span | None]:
    """A span under the current one, made current; None when not `recording`."""
    if not recording(tracer):
        return _OFF
    return tracer.start_as_current_span(name, attributes=attributes)


def root_span(
    tracer: Tracer | None, name: str, attributes: Attributes | None = None
) -> AbstractContextManager[Span | None]:
    """A span starting a trace of its own (background work, not a request); None when off."""
    if tracer is None:
        return _OFF
    return tracer.start_as_current_span(name, context=otel_context.Context(), attributes=attributes)


def record_span(
    tracer: Tracer | None,
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Attributes | None = None,
) -> None:
    """A finished span under the current one, for work timed elsewhere (the compute worker)."""
    if not recording(tracer) or start_ns <= 0:
        return
    span = tracer.start_span(name, start_time=start_ns, attributes=attributes)
    span.end(end_time=max(end_ns, start_ns))


def annotate(attributes: Attributes) -> None:
    """Set `attributes` on the current span when it is sampled (cheap check otherwise)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


def sampled_span_context() -> SpanContext | None:
    """The current span's context when it is sampled (worth linking to), else None."""
    span_context = trace.get_current_span().get_span_context()
    return span_context if span_context.trace_flags.sampled else None


def link_current(target: SpanContext, attributes: Attributes | None = None) -> None:
    """Link the current (sampled) span to `target`, e.g. a Rank to the PreInfer it consumes."""
    span = trace.get_current_span()
    if span.is_recording() and target.is_valid:
        span.add_link(target, attributes)


def current_context(tracer: Tracer | None) -> otel_context.Context | None:
    """The current context, to carry work into another task; None when tracing is off."""
    return otel_context.get_current() if tracer is not None else None


@contextmanager
def attached(ctx: otel_context.Context | None) -> Iterator[None]:
    """Run the block in `ctx` (from `current_context`); nothing happens for None."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def traceparent(span_context: SpanContext) -> str:
    """The W3C traceparent of `span_context` ("" when it is not valid)."""
    if not span_context.is_valid:
        return ""
    return (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
        f"{int(span_context.trace_flags):02x}"
    )


def span_context_of(traceparent_header: str) -> SpanContext | None:
    """The remote span context a W3C traceparent names; None when it is empty or malformed."""
    if not traceparent_header:
        return None
    carrier = {"traceparent": traceparent_header}
    ctx = TraceContextTextMapPropagator().extract(carrier)
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None


def record_linked_span(
    tracer: Tracer | None,
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Attributes | None,
    link: SpanContext | None,
    link_attributes: Attributes | None = None,
) -> None:
    """`record_span` with a link to `link` (None: none), e.g. a fetch to its producer."""
    if not recording(tracer) or start_ns <= 0:
        return
    links = [] if link is None else [trace.Link(link, link_attributes)]
    span = tracer.start_span(name, start_time=start_ns, attributes=attributes, links=links)
    span.end(end_time=max(end_ns, start_ns))
