"""The one etcd client of RelayGR: aetcd over a list of endpoints, failing over between them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aetcd
import aetcd.rpc

from relaygr.aio import cancellation_requests
from relaygr.errors import ConfigError, InvalidInput, Unavailable
from relaygr.etcd.errors import EtcdAuthFailed, EtcdRejected
from relaygr.etcd.lease import KeptLease, Lease
from relaygr.etcd.retry import unreachable
from relaygr.etcd.security import EtcdSecurity
from relaygr.etcd.tls_client import TlsAetcdClient, channel_credentials
from relaygr.etcd.watch import Watch, WatchEvent

log = logging.getLogger(__name__)

T = TypeVar("T")

# gRPC keepalive finds a half-open connection (etcd host gone without a RST) so a watch stream
# cannot hang forever; etcd refuses pings more often than every 5 s (--grpc-keepalive-min-time).
_CHANNEL_OPTIONS = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    # Subchannels are otherwise shared process-wide: a fresh client would inherit another
    # channel's reconnect backoff from an outage and fail fast with its stale error.
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 2_000,
}
# How long past its gRPC deadline an attempt may take before it counts as unreachable.
_SLACK_S = 1.0
# What etcd answers (INVALID_ARGUMENT) when a client's credentials are missing or wrong.
_AUTH_REFUSALS = ("authentication failed", "user name is empty", "user name not found")


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.removeprefix("http://").removeprefix("https://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {endpoint!r} is not 'host:port' (e.g. 'etcd-0:2379')")
    return host, int(port)


class EtcdClient:
    """An asyncio etcd v3 client over a list of endpoints.

    Invariants: at most one aetcd connection is open, to `endpoint`; it stays until a call on it
    finds the endpoint unreachable, then it is closed and the next endpoint (cyclically) is used,
    each call trying every endpoint once more before raising `Unavailable`; a call cancelled by
    gRPC because another caller closed its channel so is tried again too. Keys are str (UTF-8),
    values bytes. Watches and kept leases started here are stopped by `close()`.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        request_timeout_s: float = 5.0,
        security: EtcdSecurity | None = None,
    ) -> None:
        """`security` None: plaintext without authentication (etcd's default)."""
        if not endpoints:
            raise ConfigError("etcd endpoints must name at least one 'host:port'")
        self._endpoints = [_parse_endpoint(e) for e in endpoints]
        self._timeout_s = request_timeout_s
        self._security = security or EtcdSecurity()
        # Read once, so a missing certificate file is a configuration error at start-up.
        self._credentials = channel_credentials(self._security)
        self._index = 0
        self._client: Any = None  # aetcd.Client, created lazily for self._index
        self._children: set[Watch | KeptLease] = set()
        self._closing: set[asyncio.Task[None]] = set()  # failed clients being closed

    @property
    def endpoint(self) -> str:
        """The endpoint in use (or to be tried next)."""
        host, port = self._endpoints[self._index]
        return f"{host}:{port}"

    def _describe(self) -> str:
        return ", ".join(f"{host}:{port}" for host, port in self._endpoints)

    def current(self) -> Any:
        """The aetcd client for the current endpoint, created on first use."""
        if self._client is None:
            host, port = self._endpoints[self._index]
            kwargs = {
                # EtcdSecurity sets both or neither; aetcd wants None for no authentication.
                "username": self._security.user or None,
                "password": self._security.password or None,
                "timeout": self._timeout_s, "options": _CHANNEL_OPTIONS,
            }  # fmt: skip
            if self._credentials is None:
                self._client = aetcd.Client(host, port, **kwargs)
            else:
                self._client = TlsAetcdClient(host, port, self._credentials, **kwargs)
        return self._client

    @property
    def attempt_timeout_s(self) -> float:
        """How long one call into aetcd may take before it counts as unreachable: its gRPC
        deadline and a second."""
        return self._timeout_s + _SLACK_S

    async def drop(self, client: Any) -> None:
        """Give up `client` after it failed; if still current, move on to the next endpoint.

        It is closed in the background: closing an aetcd client waits on its watcher's locks,
        which a call stuck on the failing channel may hold, and the caller moves on now."""
        if self._client is client:
            self._client = None
            self._index = (self._index + 1) % len(self._endpoints)
        task = asyncio.get_running_loop().create_task(self._close_failed(client))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_failed(self, client: Any) -> None:
        # Best effort: the channel is already failing.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), self._timeout_s)

    async def _call(self, what: str, op: Callable[[Any], Awaitable[T]]) -> T:
        # One more try than endpoints: a single endpoint that restarted gets a fresh channel
        # (gRPC's own reconnect backoff on the old one can lag the restart by seconds).
        last: BaseException | None = None
        before = cancellation_requests()
        for _ in range(len(self._endpoints) + 1):
            client = self.current()
            try:
                # aetcd bounds its gRPC calls but not each of its own waits (a lock of its
                # watcher's, say): a call held there must not hold its caller (a lease keeper)
                # past its lease.
                return await asyncio.wait_for(op(client), self.attempt_timeout_s)
            except asyncio.CancelledError as err:
                if cancellation_requests() > before:
                    raise  # this caller was cancelled
                # Another caller found the endpoint unreachable and closed the channel under
                # this call, which gRPC cancels: try again on a fresh one. Raised on, it would
                # end the caller's task as if cancelled (a lease keeper so ended left its lease
                # to lapse while it still read connected).
                last = err
                await self.drop(client)
            except aetcd.InvalidArgumentError as err:
                if any(refusal in str(err) for refusal in _AUTH_REFUSALS):
                    endpoint = self.endpoint
                    await self.drop(client)
                    raise EtcdAuthFailed(
                        f"etcd at {endpoint} refused this client ({what}): {err}; check"
                        f" etcd_user and etcd_password ({self._security.describe()})"
                    ) from err
                raise InvalidInput(f"etcd {what}: {err}") from err
            except (aetcd.ClientError, aetcd.rpc.BaseError, TimeoutError) as err:
                if not unreachable(err):
                    raise EtcdRejected(f"etcd {what}: {err}") from err
                last = err
                await self.drop(client)
        raise Unavailable(f"etcd unreachable at {self._describe()}: {what}: {last}") from last

    async def connect(self) -> str:
        """Find an endpoint that answers (raising `Unavailable` if none does); return it."""
        await self._call("connect", lambda c: c.get(b"\0relaygr-probe"))
        return self.endpoint

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        """Set `key` (under `lease`, if given); return the store revision of the write."""
        lease_id = lease.id if lease is not None else None
        reply = await self._call(f"put {key!r}", lambda c: c.put(key.encode(), value, lease_id))
        return int(reply.header.revision)

    async def get(self, key: str) -> bytes | None:
        reply = await self._call(f"get {key!r}", lambda c: c.get(key.encode()))
        return None if reply is None else bytes(reply.value)

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """All keys under `prefix` with their values, and the store revision they were read at."""
        reply = await self._call(f"get prefix {prefix!r}", lambda c: c.get_prefix(prefix.encode()))
        values = {kv.key.decode(): bytes(kv.value) for kv in reply.kvs}
        return values, int(reply.header.revision)

    async def delete(self, key: str) -> bool:
        """Delete `key`; return whether it existed."""
        reply = await self._call(f"delete {key!r}", lambda c: c.delete(key.encode()))
        return reply is not None

    async def grant_lease(self, ttl_s: int) -> Lease:
        """A lease that expires `ttl_s` after grant unless refreshed (etcd may round `ttl_s` up)."""
        reply = await self._call(f"grant lease ttl={ttl_s}s", lambda c: c.lease(ttl_s))
        return Lease(id=int(reply.id), ttl_s=int(reply.ttl))

    async def revoke_lease(self, lease: Lease) -> None:
        """Revoke `lease`, deleting its keys now."""
        await self._call(f"revoke lease {lease.id}", lambda c: c.revoke_lease(lease.id))

    async def refresh_lease(self, lease: Lease) -> bool:
        """Send one keepalive; False when etcd no longer knows the lease (it expired)."""
        reply = await self._call(f"refresh lease {lease.id}", lambda c: c.refresh_lease(lease.id))
        if reply is None:  # the keepalive stream closed without answering
            raise Unavailable(f"etcd at {self.endpoint} dropped the keepalive of lease {lease.id}")
        return int(reply.TTL) > 0  # etcd answers TTL 0, not an error, for an unknown lease

    async def keep_lease(
        self, ttl_s: int, on_new_lease: Callable[[Lease], Awaitable[object]]
    ) -> KeptLease:
        """Grant a lease, await `on_new_lease(lease)`, then keep it (or a successor) alive."""
        kept = KeptLease(self, ttl_s, on_new_lease)
        await kept._start()
        self._children.add(kept)
        return kept

    async def watch_prefix(
        self,
        prefix: str,
        on_event: Callable[[WatchEvent], None],
        start_revision: int | None = None,
    ) -> Watch:
        """Deliver every change under `prefix` to `on_event` until the watch is cancelled.

        With `start_revision=None` the watch first delivers a put for every key present now (so
        the caller builds its view from events alone), before returning; with a revision it
        delivers the history from that revision on.
        """
        watch = Watch(self, prefix, on_event, start_revision)
        await watch._start()
        self._children.add(watch)
        return watch

    async def close(self) -> None:
        """Stop watches and lease keepalives started here (without revoking), then disconnect."""
        for child in list(self._children):
            await child._stop()
        self._children.clear()
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    @property
    def connected(self) -> bool:
        """Whether every watch and kept lease started here is connected (vacuously true with
        none): what the services' `relaygr_etcd_connected` metric reports."""
        return all(child.connected for child in self._children)

    def forget(self, child: object) -> None:
        """`child` (a watch or kept lease started here) has stopped: nothing to close for it."""
        if isinstance(child, Watch | KeptLease):
            self._children.discard(child)
