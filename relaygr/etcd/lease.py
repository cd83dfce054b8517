"""Leases: one granted by etcd, and one this process keeps alive (replaced when lost)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from relaygr.aio import cancel_and_wait
from relaygr.errors import RelayGRError, Unavailable
from relaygr.etcd.errors import EtcdRejected
from relaygr.etcd.retry import Backoff

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease granted by etcd: keys put under it are deleted when it expires or is revoked."""

    id: int
    ttl_s: int


class LeaseOwner(Protocol):
    """What a kept lease needs of the client that keeps it (`EtcdClient`); a port, so that this
    module never imports the client that imports it."""

    async def grant_lease(self, ttl_s: int) -> Lease: ...

    async def refresh_lease(self, lease: Lease) -> bool: ...

    async def revoke_lease(self, lease: Lease) -> None: ...

    def forget(self, child: object) -> None: ...


class KeptLease:
    """A lease this process keeps alive, replaced by a fresh one whenever it is lost.

    Invariants: one background task sends a keepalive every ttl/3 while etcd answers. The lease is
    presumed lost when etcd reports it unknown or when no keepalive succeeded for longer than its
    TTL (etcd may have expired it); then, as soon as etcd answers, a new lease is granted and
    `on_new_lease` is awaited before keepalives resume, so the owner re-puts its keys under it.
    `on_new_lease` also runs for the first lease. The old lease is not revoked on replacement:
    re-putting keys moves them to the new lease without a moment in which they are absent. After
    `revoke()` nothing is refreshed or granted.
    """

    def __init__(
        self, etcd: LeaseOwner, ttl_s: int, on_new_lease: Callable[[Lease], Awaitable[object]]
    ) -> None:
        self._etcd = etcd
        self._ttl_s = ttl_s
        self._on_new_lease = on_new_lease
        self._lease: Lease | None = None
        self._last_ok = 0.0
        self._task: asyncio.Task[None] | None = None
        self.connected = False

    @property
    def lease(self) -> Lease | None:
        """The current lease; None while a lost one awaits replacement."""
        return self._lease

    @property
    def lease_id(self) -> int | None:
        return None if self._lease is None else self._lease.id

    async def _start(self) -> None:
        lease = await self._etcd.grant_lease(self._ttl_s)
        await self._on_new_lease(lease)
        self._lease, self._last_ok, self.connected = lease, time.monotonic(), True
        self._task = asyncio.create_task(self._run(), name=f"etcd-lease-{lease.id}")

    async def _run(self) -> None:
        backoff = Backoff()
        delay = self._interval()
        while True:
            await asyncio.sleep(delay)
            try:
                if self._lease is not None and time.monotonic() - self._last_ok > self._lease.ttl_s:
                    log.warning("etcd lease %d presumed expired: replacing it", self._lease.id)
                    self._lease = None
                if self._lease is None:
                    await self._replace()
                elif not await self._etcd.refresh_lease(self._lease):
                    log.warning("etcd lease %d expired: replacing it", self._lease.id)
                    self._lease, delay = None, 0.0
                    continue
                self._last_ok, self.connected = time.monotonic(), True
                backoff.reset()
                delay = self._interval()
            except RelayGRError as err:
                if self.connected:
                    log.warning("etcd lease keepalive failing, retrying: %s", err)
                self.connected = False
                await backoff.sleep()
                delay = 0.0
            except Exception:
                # Whatever a client library raises, the keeper goes on: a keeper that died would
                # leave the lease to lapse while `connected` still read True.
                log.exception("etcd lease keepalive failed unexpectedly, retrying")
                self.connected = False
                await backoff.sleep()
                delay = 0.0

    async def _replace(self) -> None:
        lease = await self._etcd.grant_lease(self._ttl_s)
        try:
            await self._on_new_lease(lease)
        except RelayGRError:
            # etcd failed again mid re-registration, or refused the owner's put under this
            # lease (it lapsed already): grant another once it answers.
            raise
        except Exception:
            # The owner's bug; keep the lease rather than re-grant in a loop that leaks leases.
            log.exception("on_new_lease failed for etcd lease %d", lease.id)
        self._lease = lease
        log.info("etcd lease %d granted and re-registered", lease.id)

    def _interval(self) -> float:
        return (self._lease.ttl_s if self._lease is not None else self._ttl_s) / 3

    async def _stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self.connected = False

    async def revoke(self) -> None:
        """Stop keeping the lease and revoke it, deleting its keys now (best effort if etcd is down:
        then they expire after the TTL)."""
        await self._stop()
        self._etcd.forget(self)
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            await self._etcd.revoke_lease(lease)
        except Unavailable as err:
            log.warning("could not revoke etcd lease %d, it will expire: %s", lease.id, err)
        except EtcdRejected:
            pass  # already expired
