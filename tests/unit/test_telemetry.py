"""Tracing from the OTEL_* variables: what turns it on, off, and which values are refused."""

import threading

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from relaygr.errors import ConfigError
from relaygr.telemetry import Telemetry, tracing_settings
from services.router.config import RouterConfig
from services.trigger.config import TriggerConfig

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}


def _exporter_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("OtelBatch")]


@pytest.mark.parametrize(
    "env",
    [
        {},  # no endpoint: nowhere to send
        {**ENDPOINT, "OTEL_SDK_DISABLED": "true"},
        {**ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"},
        {**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_TRACES_SAMPLER": "always_on"},  # a sampler alone does not turn tracing on
    ],
)
def test_tracing_is_off_without_an_endpoint_or_when_disabled(env: dict[str, str]) -> None:
    assert tracing_settings("relaygr-ranker", env) is None
    telemetry = Telemetry.from_env("relaygr-ranker", env)
    assert telemetry.tracer_provider is None and telemetry.tracer is None
    assert telemetry.server_interceptors() == [] and telemetry.client_interceptors() == []
    assert _exporter_threads() == []
    # Nothing touched the process-global provider either.
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_defaults_with_an_endpoint() -> None:
    settings = tracing_settings("relaygr-router", ENDPOINT)
    assert settings is not None
    assert settings.service_name == "relaygr-router"
    assert settings.exporters == ("otlp",)
    assert settings.endpoint == "http://collector:4317" and settings.insecure
    assert settings.sampler_name == "parentbased_always_on"


def test_signal_specific_endpoint_service_name_resource_and_ratio() -> None:
    settings = tracing_settings(
        "relaygr-router",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://ignored:4317",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://jaeger:4317",
            "OTEL_SERVICE_NAME": "router-eu",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=staging,team=gr%20serving",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.01",
        },
    )
    assert settings is not None
    assert settings.endpoint == "https://jaeger:4317" and not settings.insecure
    assert settings.service_name == "router-eu"
    assert settings.resource_attributes == {
        "deployment.environment": "staging",
        "team": "gr serving",
    }
    sampler = settings.sampler()
    assert isinstance(sampler, ParentBased)
    assert "TraceIdRatioBased{0.01}" in sampler.get_description()
    assert isinstance(
        tracing_settings("x", {**ENDPOINT, "OTEL_TRACES_SAMPLER": "traceidratio"}).sampler(),  # type: ignore[union-attr]
        TraceIdRatioBased,
    )


def test_scheme_less_endpoint_follows_the_insecure_variable() -> None:
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}
    assert not tracing_settings("x", base).insecure  # type: ignore[union-attr]
    insecure = {**base, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    assert tracing_settings("x", insecure).insecure  # type: ignore[union-attr]


def test_console_exporter_needs_no_endpoint() -> None:
    settings = tracing_settings("x", {"OTEL_TRACES_EXPORTER": "console"})
    assert settings is not None and settings.exporters == ("console",)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER must be one of"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, r"\[0, 1\]"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "x"}, r"\[0, 1\]"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER must name some of"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "must be grpc"),
        ({"OTEL_SDK_DISABLED": "yes"}, "OTEL_SDK_DISABLED must be true or false"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "novalue"}, "is not key=value"),
    ],
)
def test_bad_values_are_refused_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tracing_settings("x", {**ENDPOINT, **env})


def test_tracing_on_starts_one_exporter_thread_and_shutdown_stops_it() -> None:
    # Nothing is exported (no span is made), so the unreachable endpoint is never dialled.
    telemetry = Telemetry.from_env("relaygr-trigger", {**ENDPOINT, "OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        assert telemetry.tracer is not None
        assert _exporter_threads() == ["OtelBatchSpanRecordProcessor"]
        resource = telemetry.tracer_provider.resource.attributes  # type: ignore[union-attr]
        assert resource["service.name"] == "relaygr-trigger"
        assert len(telemetry.server_interceptors()) == 1
    finally:
        telemetry.shutdown()
    assert _exporter_threads() == []
    assert telemetry.tracer is None


def test_metrics_and_log_options_are_config_fields() -> None:
    cfg = TriggerConfig(plaintext=True, metrics_port=9102, log_level="debug", log_format="text")
    assert (cfg.metrics_port, cfg.log_level, cfg.log_format) == (9102, "debug", "text")
    router = RouterConfig(plaintext=True)
    assert (router.metrics_port, router.log_level, router.log_format) == (0, "INFO", "json")
    with pytest.raises(ConfigError, match="metrics_port must be in"):
        RouterConfig(plaintext=True, metrics_port=70000)
    with pytest.raises(ConfigError, match="log_format must be one of"):
        RouterConfig(plaintext=True, log_format="logfmt")
