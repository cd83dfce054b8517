"""Run-time changes to the trigger's policy: a JSON object at an etcd key, validated before use."""

import json
import logging
from collections.abc import Callable

from relaygr.config import override_config
from relaygr.errors import ConfigError
from relaygr.etcd.watch import EventKind, WatchEvent
from services.trigger.config import LIVE_FIELDS, TriggerConfig

_log = logging.getLogger("services.trigger")


def live_config_key(etcd_prefix: str) -> str:
    """The etcd key whose JSON object overrides the trigger's LIVE_FIELDS."""
    return f"{etcd_prefix.rstrip('/')}/config/trigger"


class LiveConfig:
    """Follows the key `key`: its JSON object overrides the startup config's LIVE_FIELDS.

    Invariants: the config in force is always a validated TriggerConfig. A value that is not a
    JSON object, names a field that may not change at run time, or fails validation is
    rejected with a logged reason, counted in `rejected`, and the config in force stays.
    Overrides are relative to the startup config (not cumulative); deleting the key restores it.
    """

    def __init__(
        self, base: TriggerConfig, key: str, apply: Callable[[TriggerConfig], None]
    ) -> None:
        self._base = base
        self.key = key
        self._apply = apply
        self.current = base
        self.rejected = 0

    def on_event(self, event: WatchEvent) -> None:
        if event.key != self.key:
            return  # another key under the same prefix
        if event.kind is EventKind.DELETE or event.value is None:
            self._use(self._base, "deleted: back to the startup config")
            return
        source = f"live config {self.key}"
        try:
            data = json.loads(event.value)
            if not isinstance(data, dict):
                raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
            cfg = override_config(self._base, data, LIVE_FIELDS, source)
        except (ConfigError, UnicodeDecodeError, json.JSONDecodeError) as err:
            self.rejected += 1
            _log.warning("rejected %s (keeping the config in force): %s", source, err)
            return
        self._use(cfg, json.dumps(data, sort_keys=True))

    def _use(self, cfg: TriggerConfig, what: str) -> None:
        self.current = cfg
        self._apply(cfg)
        _log.info("live config %s applied: %s", self.key, what)
