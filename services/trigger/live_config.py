"""Run-time changes to the trigger's policy: a JSON object at an etcd key, validated before use."""

import logging
from collections.abc import Callable
from typing import Any

from relaygr.config import override_config
from relaygr.live_value import LiveValue
from services.trigger.config import LIVE_FIELDS, TriggerConfig

_log = logging.getLogger("services.trigger")

LiveConfig = LiveValue[TriggerConfig]


def live_config_key(etcd_prefix: str) -> str:
    """The etcd key whose JSON object overrides the trigger's LIVE_FIELDS."""
    return f"{etcd_prefix.rstrip('/')}/config/trigger"


def live_config(
    base: TriggerConfig, key: str, apply: Callable[[TriggerConfig], None]
) -> LiveConfig:
    """Follows `key`: its JSON object overrides the startup config's LIVE_FIELDS.

    The config in force is always a validated TriggerConfig; a value that names a field that
    may not change at run time, or fails validation, is rejected and the config in force stays
    (see `LiveValue`). Overrides are relative to the startup config (not cumulative); deleting
    the key restores it.
    """

    def parse(data: dict[str, Any], source: str) -> TriggerConfig:
        return override_config(base, data, LIVE_FIELDS, source)

    return LiveValue(key, base, parse, apply, _log)
