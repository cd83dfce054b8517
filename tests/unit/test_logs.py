"""JSON log lines: the fields, the current span's ids, exceptions and extras; option checks."""

import io
import json
import logging
import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from relaygr.errors import ConfigError
from relaygr.log_options import check_log_options
from relaygr.logs import JsonFormatter, configure_logging


def _record(message: str = "hello %s", args: tuple[object, ...] = ("world",)) -> logging.LogRecord:
    return logging.LogRecord("relaygr.test", logging.WARNING, __file__, 1, message, args, None)


def test_a_line_outside_any_span_has_no_ids() -> None:
    entry = json.loads(JsonFormatter("ranker").format(_record()))
    assert entry["message"] == "hello world"
    assert entry["level"] == "WARNING"
    assert entry["logger"] == "relaygr.test"
    assert entry["service"] == "ranker"
    assert entry["time"].endswith("+00:00")
    assert "trace_id" not in entry and "span_id" not in entry


def test_a_line_inside_a_span_carries_its_trace_and_span_ids() -> None:
    tracer = TracerProvider().get_tracer("test")  # no processor: spans go nowhere
    with tracer.start_as_current_span("outer"), tracer.start_as_current_span("inner") as span:
        entry = json.loads(JsonFormatter().format(_record()))
        ids = span.get_span_context()
    assert entry["trace_id"] == f"{ids.trace_id:032x}"
    assert entry["span_id"] == f"{ids.span_id:016x}"
    assert "service" not in entry


def test_an_unsampled_span_still_gives_its_ids() -> None:
    """Log lines of unsampled requests still correlate with each other by trace id."""
    tracer = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    with tracer.start_as_current_span("dropped") as span:
        entry = json.loads(JsonFormatter().format(_record()))
    assert not span.is_recording()
    assert entry["trace_id"] == f"{span.get_span_context().trace_id:032x}"


def test_exceptions_and_extra_fields_are_kept() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "relaygr.test", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    record.user_id = "u1"
    record.payload = {1, 2}  # not JSON: written as its str
    entry = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in entry["exception"]
    assert entry["user_id"] == "u1"
    assert entry["payload"] == "{1, 2}"


def test_configure_logging_sets_level_and_format() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    try:
        configure_logging("warning", "json", "router", stream)
        logging.getLogger("relaygr.x").info("dropped")
        with trace.get_tracer("t", tracer_provider=TracerProvider()).start_as_current_span("s"):
            logging.getLogger("relaygr.x").warning("kept %d", 7)
        [line] = stream.getvalue().splitlines()
        entry = json.loads(line)
        assert entry["message"] == "kept 7" and entry["service"] == "router"
        assert len(entry["trace_id"]) == 32
        stream.truncate(0)
        stream.seek(0)
        configure_logging("DEBUG", "text", "router", stream)
        logging.getLogger("relaygr.x").debug("plain")
        assert stream.getvalue().rstrip().endswith("relaygr.x DEBUG plain")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)


@pytest.mark.parametrize(
    ("level", "fmt", "message"),
    [
        ("LOUD", "json", "log_level must be one of ['DEBUG', 'INFO'"),
        ("INFO", "xml", "log_format must be one of ['json', 'text'], got 'xml'"),
    ],
)
def test_bad_options_name_the_valid_values(level: str, fmt: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        check_log_options(level, fmt, "ranker")
