"""A real OTLP/gRPC trace receiver on a free loopback port: what Jaeger's collector would get."""

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

SERVER = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT
INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass(frozen=True, slots=True)
class Link:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One exported span, ids as lowercase hex (parent "" for a root)."""

    service: str  # the resource's service.name
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    links: tuple[Link, ...]
    resource: dict[str, Any]


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """`opentelemetry.proto.collector.trace.v1.TraceService/Export` on 127.0.0.1, in its own
    threads (a synchronous gRPC server), so exporters that block their caller (force_flush on an
    event loop) never wait on that loop."""

    def __init__(self) -> None:
        self._service = _TraceService()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._service, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def exports(self) -> int:
        """Export calls received."""
        with self._service.lock:
            return len(self._service.requests)

    def spans(self) -> list[ReceivedSpan]:
        with self._service.lock:
            requests = list(self._service.requests)
        spans = []
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        spans.append(
                            ReceivedSpan(
                                service=resource.get("service.name", ""),
                                name=span.name,
                                kind=span.kind,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent_id=span.parent_span_id.hex(),
                                attributes=_attributes(span.attributes),
                                links=tuple(
                                    Link(
                                        link.trace_id.hex(),
                                        link.span_id.hex(),
                                        _attributes(link.attributes),
                                    )
                                    for link in span.links
                                ),
                                resource=resource,
                            )
                        )
        return spans

    def stop(self) -> None:
        self._server.stop(grace=None).wait()


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.stop()
