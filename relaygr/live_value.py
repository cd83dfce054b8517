"""Run-time settings at one etcd key: a JSON object, validated before use, the last good kept."""

import json
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from relaygr.errors import ConfigError
from relaygr.etcd.watch import EventKind, WatchEvent
from relaygr.json_object import json_object
from relaygr.versions import VersionPolicy, versions_key

T = TypeVar("T")


class LiveValue(Generic[T]):
    """Follows the etcd key `key` (feed it the events of a watch on it): its JSON object,
    turned into a T by `parse`, is the value in force; deleting the key restores `default`.

    Invariants: the value in force is always one `parse` accepted (or `default`). A value that
    is not a JSON object, or that `parse` refuses with ConfigError, is rejected with a logged
    reason (on `log`), counted in `rejected`, and the value in force stays. `apply` is called
    with each value put in force.
    """

    def __init__(
        self,
        key: str,
        default: T,
        parse: Callable[[dict[str, Any], str], T],
        apply: Callable[[T], None],
        log: logging.Logger,
    ) -> None:
        """`parse(data, source)` builds the value from the key's JSON object; `source` names
        the key for its error messages."""
        self.key = key
        self._default = default
        self._parse = parse
        self._apply = apply
        self._log = log
        self.current = default
        self.rejected = 0

    def on_event(self, event: WatchEvent) -> None:
        if event.key != self.key:
            return  # another key under the same prefix
        if event.kind is EventKind.DELETE or event.value is None:
            self._use(self._default, "deleted: back to the default")
            return
        source = f"live config {self.key}"
        try:
            data = json_object(event.value, source, ConfigError)
            value = self._parse(data, source)
        except ConfigError as err:
            self.rejected += 1
            self._log.warning("rejected %s (keeping the value in force): %s", source, err)
            return
        self._use(value, json.dumps(data, sort_keys=True))

    def _use(self, value: T, what: str) -> None:
        self.current = value
        self._apply(value)
        self._log.info("live config %s applied: %s", self.key, what)


def live_policy(
    etcd_prefix: str, apply: Callable[[VersionPolicy], None], log: logging.Logger
) -> LiveValue[VersionPolicy]:
    """The live policy at `versions_key(etcd_prefix)` (feed it a watch on that key): each valid
    value is passed to `apply`; a bad one is logged on `log`, counted and ignored; deleting the
    key restores the default policy."""
    return LiveValue(
        versions_key(etcd_prefix), VersionPolicy(), VersionPolicy.from_mapping, apply, log
    )
