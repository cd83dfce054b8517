"""One service's telemetry: a tracer provider built from the standard OTEL_* variables (or none:
tracing off), its Prometheus registry, and the gRPC interceptors that carry W3C trace context.

Nothing here touches OpenTelemetry's process-global tracer provider: each service holds its own
(`Telemetry.tracer_provider`), so several services in one process (tests) keep their own
`service.name`, and tracing off means no provider, no exporter thread and no interceptor at all.
"""

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import service_prefix
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry, ProcessCollector

from relaygr.errors import ConfigError

_log = logging.getLogger(__name__)

SAMPLERS = (
    "always_on", "always_off", "traceidratio",
    "parentbased_always_on", "parentbased_always_off", "parentbased_traceidratio",
)  # fmt: skip
EXPORTERS = ("otlp", "console", "none")
INSTRUMENTATION_NAME = "relaygr"
# Only RelayGR's own RPCs are traced: health probes and reflection would flood the traces.
_TRACED_RPCS = service_prefix("relaygr.")


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Tracing as the OTEL_* variables ask for it; `tracing_settings` returns None for off."""

    service_name: str
    exporters: tuple[str, ...]  # "otlp" and/or "console"
    endpoint: str  # OTLP gRPC endpoint ("" unless "otlp" is among the exporters)
    insecure: bool  # plaintext gRPC to the endpoint (http:// scheme or *_INSECURE=true)
    sampler_name: str
    sampler_ratio: float
    resource_attributes: Mapping[str, str] = field(default_factory=dict)

    def sampler(self) -> Sampler:
        ratio = TraceIdRatioBased(self.sampler_ratio)
        return {
            "always_on": ALWAYS_ON,
            "always_off": ALWAYS_OFF,
            "traceidratio": ratio,
            "parentbased_always_on": ParentBased(ALWAYS_ON),
            "parentbased_always_off": ParentBased(ALWAYS_OFF),
            "parentbased_traceidratio": ParentBased(ratio),
        }[self.sampler_name]


def _flag(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return None
    if raw not in ("true", "false"):
        raise ConfigError(f"{name} must be true or false, got {env[name]!r}")
    return raw == "true"


def _resource_attributes(raw: str) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES: comma-separated key=value pairs, values percent-encoded."""
    attributes: dict[str, str] = {}
    for pair in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"OTEL_RESOURCE_ATTRIBUTES: {pair!r} is not key=value")
        attributes[key.strip()] = unquote(value.strip())
    return attributes


def tracing_settings(default_service: str, env: Mapping[str, str]) -> TracingSettings | None:
    """What `env` asks of tracing, or None for off: OTEL_SDK_DISABLED=true, the exporter
    `none`, or the OTLP exporter with no endpoint. Invalid values raise ConfigError naming them.

    Read: OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER (otlp, console, none; default otlp),
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT (gRPC, e.g.
    http://localhost:4317), OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL (grpc only),
    OTEL_EXPORTER_OTLP[_TRACES]_INSECURE, OTEL_SERVICE_NAME (default `default_service`),
    OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER (default parentbased_always_on) and
    OTEL_TRACES_SAMPLER_ARG (the ratio, default 1.0). The exporter reads its own further
    variables (headers, certificates, timeout, compression) and the batch processor its
    OTEL_BSP_* ones.
    """
    if _flag(env, "OTEL_SDK_DISABLED"):
        return None
    raw_exporters = env.get("OTEL_TRACES_EXPORTER", "otlp")
    exporters = tuple(dict.fromkeys(e.strip().lower() for e in raw_exporters.split(",")))
    bad = [e for e in exporters if e not in EXPORTERS]
    if bad or not exporters:
        raise ConfigError(f"OTEL_TRACES_EXPORTER must name some of {list(EXPORTERS)}, got {bad}")
    exporters = tuple(e for e in exporters if e != "none")
    endpoint = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    ).strip()
    if "otlp" in exporters and not endpoint:
        exporters = tuple(e for e in exporters if e != "otlp")  # no endpoint: nowhere to send
    if not exporters:
        return None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if "otlp" in exporters and protocol.strip().lower() != "grpc":
        raise ConfigError(f"OTLP protocol must be grpc (port 4317), got {protocol!r}")
    scheme = urlparse(endpoint).scheme if "://" in endpoint else ""
    insecure_flag = _flag(env, "OTEL_EXPORTER_OTLP_TRACES_INSECURE")
    if insecure_flag is None:
        insecure_flag = _flag(env, "OTEL_EXPORTER_OTLP_INSECURE")
    insecure = scheme == "http" or (scheme != "https" and bool(insecure_flag))
    sampler_name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if sampler_name not in SAMPLERS:
        raise ConfigError(
            f"OTEL_TRACES_SAMPLER must be one of {list(SAMPLERS)}, got {sampler_name!r}"
        )
    ratio = 1.0
    if "traceidratio" in sampler_name and env.get("OTEL_TRACES_SAMPLER_ARG", "").strip():
        try:
            ratio = float(env["OTEL_TRACES_SAMPLER_ARG"])
        except ValueError as err:
            raise ConfigError("OTEL_TRACES_SAMPLER_ARG must be a ratio in [0, 1]") from err
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a ratio in [0, 1], got {ratio}")
    attributes = _resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    service = env.get("OTEL_SERVICE_NAME", "").strip() or attributes.get(
        "service.name", default_service
    )
    return TracingSettings(
        service_name=service,
        exporters=exporters,
        endpoint=endpoint if "otlp" in exporters else "",
        insecure=insecure,
        sampler_name=sampler_name,
        sampler_ratio=ratio,
        resource_attributes=attributes,
    )


def build_tracer_provider(
    settings: TracingSettings, extra_resource: Mapping[str, str] | None = None
) -> TracerProvider:
    """A tracer provider exporting in batches as `settings` say (starts one exporter thread)."""
    resource = Resource(
        {
            **settings.resource_attributes,
            **(extra_resource or {}),
            "service.name": settings.service_name,
        }
    )
    provider = TracerProvider(resource=resource, sampler=settings.sampler())
    for name in settings.exporters:
        exporter: SpanExporter
        if name == "otlp":
            # Imported here: the exporter pulls in its own protobuf and gRPC client stack.
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=settings.endpoint, insecure=settings.insecure)
        else:
            exporter = ConsoleSpanExporter(service_name=settings.service_name)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def service_registry() -> CollectorRegistry:
    """A registry of one service's metrics, with the standard process metrics (process_*)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


@dataclass(slots=True)
class Telemetry:
    """What one service reports through.

    `tracer_provider` None means tracing is off: no spans, no interceptors, no exporter.
    `registry` holds the service's Prometheus metrics (its own, so that services sharing a
    process do not collide). `metrics_address` is where the service serves `/metrics`
    (host, port; port 0 picks a free one); None serves nothing. Whoever builds a Telemetry
    shuts it down (`shutdown` flushes the spans still batched).
    """

    service_name: str
    tracer_provider: TracerProvider | None = None
    registry: CollectorRegistry = field(default_factory=service_registry)
    metrics_address: tuple[str, int] | None = None

    @classmethod
    def from_env(
        cls,
        service_name: str,
        env: Mapping[str, str],
        metrics_address: tuple[str, int] | None = None,
        instance_id: str = "",
    ) -> "Telemetry":
        """Tracing as `env`'s OTEL_* variables say, `/metrics` at `metrics_address` (None:
        none)."""
        settings = tracing_settings(service_name, env)
        provider = None
        if settings is not None:
            extra = {"service.instance.id": instance_id} if instance_id else {}
            provider = build_tracer_provider(settings, extra)
            _log.info(
                "tracing to %s as %s, sampler %s",
                settings.endpoint or ",".join(settings.exporters),
                settings.service_name,
                settings.sampler_name,
            )
        return cls(service_name, provider, metrics_address=metrics_address)

    @property
    def tracer(self) -> Tracer | None:
        if self.tracer_provider is None:
            return None
        return self.tracer_provider.get_tracer(INSTRUMENTATION_NAME)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Server spans from incoming W3C trace context; none when tracing is off."""
        if self.tracer_provider is None:
            return []
        return [aio_server_interceptor(tracer_provider=self.tracer_provider, filter_=_TRACED_RPCS)]

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """Client spans that send W3C trace context; none when tracing is off."""
        if self.tracer_provider is None:
            return []
        interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(
            tracer_provider=self.tracer_provider, filter_=_TRACED_RPCS
        )
        return interceptors

    def shutdown(self) -> None:
        """Export what is batched and stop the exporter (blocks up to its timeout)."""
        provider, self.tracer_provider = self.tracer_provider, None
        if provider is not None:
            with contextlib.suppress(Exception):  # a collector that is down loses the tail
                provider.shutdown()
