"""The log options every service takes (level, format) and their validation."""

from relaygr.errors import ConfigError

LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def check_log_options(level: str, log_format: str, what: str) -> None:
    """Raise ConfigError naming the valid values when `level` or `log_format` is not one."""
    if level.upper() not in LOG_LEVELS:
        raise ConfigError(f"{what} log_level must be one of {list(LOG_LEVELS)}, got {level!r}")
    if log_format not in LOG_FORMATS:
        raise ConfigError(
            f"{what} log_format must be one of {list(LOG_FORMATS)}, got {log_format!r}"
        )
