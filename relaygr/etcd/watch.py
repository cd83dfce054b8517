"""Watches: every change under a key prefix, in revision order, across outages and compaction."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import aetcd
import aetcd.rpc

from relaygr.aio import cancel_and_wait, cancellation_requests
from relaygr.errors import RelayGRError
from relaygr.etcd.retry import Backoff, unreachable

log = logging.getLogger(__name__)


class EventKind(StrEnum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under a watched prefix; `value` is None for deletes."""

    kind: EventKind
    key: str
    value: bytes | None
    revision: int


class WatchOwner(Protocol):
    """What a watch needs of the client that started it (`EtcdClient`); a port, so that this
    module never imports the client that imports it."""

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]: ...

    def current(self) -> Any:
        """The connected aetcd client (connecting, or failing over, first)."""
        ...

    @property
    def attempt_timeout_s(self) -> float:
        """How long one call into the client library may take before it counts as unreachable."""
        ...

    async def drop(self, client: Any) -> None:
        """Give up `client` as unreachable (the next `current` fails over)."""
        ...

    def forget(self, child: object) -> None: ...


class Watch:
    """A watch on a key prefix that survives etcd restarts, failovers and compaction.

    Invariants: `on_event` is called from one task, in revision order, for each change after
    `last_revision`; after an error the watch is re-created from `last_revision + 1`, so nothing
    is missed or repeated. If etcd compacted that revision away, a full read replaces the
    history: a put for each present key and a delete for each key seen before but now absent, all
    at the read's revision, and watching resumes after it. `on_event` must not block; exceptions
    it raises are logged and the watch goes on.
    """

    def __init__(
        self,
        etcd: WatchOwner,
        prefix: str,
        on_event: Callable[[WatchEvent], None],
        start_revision: int | None,
    ) -> None:
        self._etcd = etcd
        self.prefix = prefix
        self._on_event = on_event
        self._resync_needed = start_revision is None
        self.last_revision = 0 if start_revision is None else start_revision - 1
        self._known: set[str] = set()
        self._stream: Any = None  # the current aetcd.Watch
        self._task: asyncio.Task[None] | None = None
        self.connected = False

    async def _start(self) -> None:
        if self._resync_needed:
            await self._resync()
        self._task = asyncio.create_task(self._run(), name=f"etcd-watch-{self.prefix}")

    async def _resync(self) -> None:
        values, revision = await self._etcd.get_prefix(self.prefix)
        for key in sorted(self._known - values.keys()):
            self._deliver(WatchEvent(EventKind.DELETE, key, None, revision))
        for key, value in values.items():
            self._deliver(WatchEvent(EventKind.PUT, key, value, revision))
        self._known = set(values)
        self.last_revision = revision
        self._resync_needed = False

    def _deliver(self, event: WatchEvent) -> None:
        self.last_revision = max(self.last_revision, event.revision)
        if event.kind is EventKind.PUT:
            self._known.add(event.key)
        else:
            self._known.discard(event.key)
        try:
            self._on_event(event)
        except Exception:
            log.exception("etcd watch callback failed for %s", event)

    async def _run(self) -> None:
        backoff = Backoff()
        before = cancellation_requests()
        while True:
            client = None
            try:
                if self._resync_needed:
                    await self._resync()
                client = self._etcd.current()
                # Bounded: aetcd's own locks can hold a watch's creation on a failing channel.
                self._stream = await asyncio.wait_for(
                    client.watch_prefix(
                        self.prefix.encode(), start_revision=self.last_revision + 1
                    ),
                    self._etcd.attempt_timeout_s,
                )
                self.connected = True
                backoff.reset()
                async for event in self._stream:
                    kind = EventKind.PUT if event.kind == "PUT" else EventKind.DELETE
                    value = bytes(event.kv.value) if kind is EventKind.PUT else None
                    key = event.kv.key.decode()
                    self._deliver(WatchEvent(kind, key, value, int(event.kv.mod_revision)))
                # The stream ended without an error: its channel was closed by a failover.
            except aetcd.RevisionCompactedError:
                log.warning(
                    "etcd watch %r: revision %d compacted, resyncing",
                    self.prefix,
                    self.last_revision + 1,
                )
                self._resync_needed = True
                continue
            except asyncio.CancelledError:
                if cancellation_requests() > before:
                    raise  # stopped
                # gRPC cancelled a call of this watch's: another caller's failover closed the
                # channel under it. Raised on, it would end the watch, its view frozen.
                if client is not None:
                    await self._etcd.drop(client)
            except RelayGRError as err:  # from a resync, which already failed over
                log.debug("etcd watch %r resync failed: %s", self.prefix, err)
            except (aetcd.ClientError, aetcd.rpc.BaseError, TimeoutError) as err:
                if client is not None and unreachable(err):
                    await self._etcd.drop(client)
                else:
                    log.warning("etcd watch %r failed, re-creating: %s", self.prefix, err)
            except Exception:
                # Whatever a client library raises, the watch goes on from its last revision: a
                # watch that died would freeze its view while `connected` still read True.
                log.exception("etcd watch %r failed unexpectedly, re-creating", self.prefix)
                if client is not None:
                    await self._etcd.drop(client)
            if self.connected:
                log.warning(
                    "etcd watch %r lost at revision %d, re-creating",
                    self.prefix,
                    self.last_revision,
                )
            self.connected = False
            await backoff.sleep()

    async def _stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        stream, self._stream = self._stream, None
        if stream is not None:
            # Best effort: unregister from aetcd's shared stream, which may already be closed;
            # one torn down under us cancels its own futures, which must not end this close
            # (only a cancellation of this task does).
            before = cancellation_requests()
            try:
                await asyncio.wait_for(stream.cancel(), timeout=1.0)
            except asyncio.CancelledError:
                if cancellation_requests() > before:
                    raise
            except Exception:
                pass
        self.connected = False

    async def cancel(self) -> None:
        """Stop delivering events."""
        await self._stop()
        self._etcd.forget(self)
