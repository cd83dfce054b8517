"""The error hierarchy shared by every service; one server interceptor maps it to gRPC codes."""


class RelayGRError(Exception):
    """Base of every error RelayGR raises on purpose."""


class InvalidInput(RelayGRError):
    """The request is malformed or over a configured limit (gRPC INVALID_ARGUMENT)."""


class ResourceExhausted(RelayGRError):
    """The work cannot be held within a budget (gRPC RESOURCE_EXHAUSTED)."""


class Unavailable(RelayGRError):
    """No instance can serve the request now; retrying may succeed (gRPC UNAVAILABLE)."""


class FailedPrecondition(RelayGRError):
    """The request cannot be served here as asked, e.g. it names another model version than
    this ranker serves (gRPC FAILED_PRECONDITION): resending it here will not help."""


class ConfigError(RelayGRError):
    """A configuration value is invalid; the message names the valid values."""


class DeviceUnavailable(ConfigError):
    """The requested accelerator is not present or its runtime is not installed."""


class DeadlineExceeded(RelayGRError):
    """The caller's deadline passed before the work finished (gRPC DEADLINE_EXCEEDED)."""
