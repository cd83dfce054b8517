"""Service logging: one JSON object per line carrying the current trace and span ids, or text."""

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from opentelemetry import trace

from relaygr.log_options import check_log_options

_TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: time (UTC, ISO 8601), level, logger, message, the
    trace and span ids of the span current where the record was made (when there is a valid
    one), the service, the exception's traceback and any `extra=` fields.

    The ids are read at format time, so the handler must format in the logging thread (a plain
    StreamHandler does; a QueueHandler would lose them).
    """

    def __init__(self, service: str = "") -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self._service:
            entry["service"] = self._service
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            entry["trace_id"] = trace.format_trace_id(span_context.trace_id)
            entry["span_id"] = trace.format_span_id(span_context.span_id)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in entry:
                entry[key] = value
        return json.dumps(entry, default=str)


def configure_logging(
    level: str, log_format: str, service: str = "", stream: TextIO | None = None
) -> logging.Handler:
    """Send the root logger's records at `level` and above to `stream` (stderr) as JSON lines
    or text, replacing its handlers; returns the handler installed."""
    check_log_options(level, log_format, service or "service")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(
        JsonFormatter(service) if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
