"""The one etcd client of RelayGR: aetcd with failover, kept leases and self-healing watches."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import aetcd.rpc
import aetcd.watcher
import grpc

from relaygr.aio import cancel_and_wait
from relaygr.errors import ConfigError, InvalidInput, RelayGRError, Unavailable
from relaygr.tls import read_pem

log = logging.getLogger(__name__)

T = TypeVar("T")

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 2.0
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
# Status codes meaning "this endpoint did not answer", as opposed to "etcd refused the request".
# CANCELLED is what calls in flight get when a failed-over channel is closed under them.
_UNREACHABLE_CODES = frozenset(
    {
        aetcd.rpc.StatusCode.UNAVAILABLE,
        aetcd.rpc.StatusCode.DEADLINE_EXCEEDED,
        aetcd.rpc.StatusCode.CANCELLED,
        # An expired auth token (etcd's simple tokens lapse after --auth-token-ttl idle): a fresh
        # connection authenticates again.
        aetcd.rpc.StatusCode.UNAUTHENTICATED,
    }
)
# What etcd answers (INVALID_ARGUMENT) when a client's credentials are missing or wrong.
_AUTH_REFUSALS = ("authentication failed", "user name is empty", "user name not found")


class EtcdRejected(RelayGRError):
    """etcd answered but refused the request (e.g. its lease expired); a plain retry won't help."""


class EtcdAuthFailed(ConfigError):
    """etcd refused this client's user name or password: the configuration must change."""


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """How a client reaches a secured etcd: TLS (when `ca` or `cert` is set) and/or a user.

    `ca` verifies etcd's certificate (system roots when unset); `cert` and `key` are the client
    certificate etcd's `--client-cert-auth` asks for; `user` and `password` authenticate to
    etcd's auth (the password never appears in a repr or a log line).
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str = ""
    password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("etcd_cert and etcd_key must be set together")
        if self.user and not self.password:
            raise ConfigError(
                f"etcd_user {self.user!r} is set but etcd_password is empty: set the password"
                " (in deployments through the environment, RELAYGR_<SERVICE>_ETCD_PASSWORD)"
            )
        if self.password and not self.user:
            raise ConfigError("etcd_password is set but etcd_user is empty")

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    def describe(self) -> str:
        """How the client reaches etcd, for logs (never the password)."""
        parts = ["TLS" if self.tls else "plaintext"]
        if self.cert is not None:
            parts.append("client certificate")
        if self.user:
            parts.append(f"user {self.user!r}")
        return ", ".join(parts)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "etcd_ca"),
            private_key=read_pem(self.key, "etcd_key"),
            certificate_chain=read_pem(self.cert, "etcd_cert"),
        )


class _TlsAetcdClient(aetcd.Client):  # type: ignore[misc]
    """An aetcd client over TLS: aetcd 1.0.0 only dials plaintext.

    `connect` builds what aetcd's own does (channel, optional Authenticate, stubs, watcher) on a
    secure channel; it relies on aetcd 1.0.0's attribute names, so check it when aetcd (pinned
    in pyproject.toml) is upgraded. gRPC errors raised here reach the caller through the public
    method that connected, which maps them to aetcd's exceptions.
    """

    _is_connecting: bool  # aetcd's own attributes, set by its __init__

    def __init__(
        self, host: str, port: int, credentials: grpc.ChannelCredentials, **kwargs: Any
    ) -> None:
        aetcd.Client.__init__(self, host, port, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        channel = grpc.aio.secure_channel(
            f"{self._host}:{self._port}", self._credentials, options=list(self._options.items())
        )
        try:
            metadata = None
            if self._username is not None:
                request = aetcd.rpc.AuthenticateRequest(
                    name=self._username, password=self._password
                )
                reply = await aetcd.rpc.AuthStub(channel).Authenticate(
                    request, timeout=self._timeout
                )
                metadata = (("token", reply.token),)
        except BaseException:
            await channel.close()
            raise
        finally:
            self._is_connecting = False
        self.channel, self.metadata = channel, metadata
        self.kvstub = aetcd.rpc.KVStub(channel)
        self.clusterstub = aetcd.rpc.ClusterStub(channel)
        self.leasestub = aetcd.rpc.LeaseStub(channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(channel)
        self._watcher = aetcd.watcher.Watcher(
            aetcd.rpc.WatchStub(channel), timeout=self._timeout, metadata=metadata
        )
        self._connected.set()


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease granted by etcd: keys put under it are deleted when it expires or is revoked."""

    id: int
    ttl_s: int


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


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.removeprefix("http://").removeprefix("https://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {endpoint!r} is not 'host:port' (e.g. 'etcd-0:2379')")
    return host, int(port)


def _unreachable(err: BaseException) -> bool:
    """Whether `err` says the endpoint did not answer (fail over) rather than refused (report)."""
    if isinstance(
        err,
        aetcd.ConnectionFailedError
        | aetcd.ConnectionTimeoutError
        | aetcd.WatchTimeoutError
        | TimeoutError,
    ):
        return True
    rpc_error = err if isinstance(err, aetcd.rpc.AioRpcError) else err.__cause__
    if isinstance(rpc_error, aetcd.rpc.AioRpcError):
        return rpc_error.code() in _UNREACHABLE_CODES
    # e.g. grpc's UsageError for a call started on a channel closed by a failover.
    return isinstance(err, aetcd.rpc.BaseError)


class _Backoff:
    """Sleeps 0.1 s, doubling to at most 2 s, until reset: retry loops never spin."""

    def __init__(self) -> None:
        self._delay = _BACKOFF_START_S

    def reset(self) -> None:
        self._delay = _BACKOFF_START_S

    async def sleep(self) -> None:
        await asyncio.sleep(self._delay)
        self._delay = min(self._delay * 2, _BACKOFF_MAX_S)


class EtcdClient:
    """An asyncio etcd v3 client over a list of endpoints.

    Invariants: at most one aetcd connection is open, to `endpoint`; it stays until a call on it
    finds the endpoint unreachable, then it is closed and the next endpoint (cyclically) is used,
    each call trying every endpoint once more before raising `Unavailable`. Keys are str (UTF-8),
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
        self._credentials = self._security.channel_credentials()
        self._index = 0
        self._client: Any = None  # aetcd.Client, created lazily for self._index
        self._children: set[Watch | KeptLease] = set()

    @property
    def endpoint(self) -> str:
        """The endpoint in use (or to be tried next)."""
        host, port = self._endpoints[self._index]
        return f"{host}:{port}"

    def _describe(self) -> str:
        return ", ".join(f"{host}:{port}" for host, port in self._endpoints)

    def _current(self) -> Any:
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
                self._client = _TlsAetcdClient(host, port, self._credentials, **kwargs)
        return self._client

    async def _drop(self, client: Any) -> None:
        """Close `client` after it failed; if still current, move on to the next endpoint."""
        if self._client is client:
            self._client = None
            self._index = (self._index + 1) % len(self._endpoints)
        with contextlib.suppress(Exception):  # best effort: the channel is already failing
            await client.close()

    async def _call(self, what: str, op: Callable[[Any], Awaitable[T]]) -> T:
        # One more try than endpoints: a single endpoint that restarted gets a fresh channel
        # (gRPC's own reconnect backoff on the old one can lag the restart by seconds).
        last: BaseException | None = None
        for _ in range(len(self._endpoints) + 1):
            client = self._current()
            try:
                return await op(client)
            except aetcd.InvalidArgumentError as err:
                if any(refusal in str(err) for refusal in _AUTH_REFUSALS):
                    endpoint = self.endpoint
                    await self._drop(client)
                    raise EtcdAuthFailed(
                        f"etcd at {endpoint} refused this client ({what}): {err}; check"
                        f" etcd_user and etcd_password ({self._security.describe()})"
                    ) from err
                raise InvalidInput(f"etcd {what}: {err}") from err
            except (aetcd.ClientError, aetcd.rpc.BaseError, TimeoutError) as err:
                if not _unreachable(err):
                    raise EtcdRejected(f"etcd {what}: {err}") from err
                last = err
                await self._drop(client)
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

    async def _refresh_lease(self, lease: Lease) -> bool:
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

    @property
    def connected(self) -> bool:
        """Whether every watch and kept lease started here is connected (vacuously true with
        none): what the services' `relaygr_etcd_connected` metric reports."""
        return all(child.connected for child in self._children)

    def _forget(self, child: Watch | KeptLease) -> None:
        self._children.discard(child)


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
        self, etcd: EtcdClient, ttl_s: int, on_new_lease: Callable[[Lease], Awaitable[object]]
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
        backoff = _Backoff()
        delay = self._interval()
        while True:
            await asyncio.sleep(delay)
            try:
                if self._lease is not None and time.monotonic() - self._last_ok > self._lease.ttl_s:
                    log.warning("etcd lease %d presumed expired: replacing it", self._lease.id)
                    self._lease = None
                if self._lease is None:
                    await self._replace()
                elif not await self._etcd._refresh_lease(self._lease):
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

    async def _replace(self) -> None:
        lease = await self._etcd.grant_lease(self._ttl_s)
        try:
            await self._on_new_lease(lease)
        except Unavailable:
            raise  # etcd failed again mid re-registration: grant another once it answers
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
        self._etcd._forget(self)
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            await self._etcd.revoke_lease(lease)
        except Unavailable as err:
            log.warning("could not revoke etcd lease %d, it will expire: %s", lease.id, err)
        except EtcdRejected:
            pass  # already expired


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
        etcd: EtcdClient,
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
        backoff = _Backoff()
        while True:
            client = None
            try:
                if self._resync_needed:
                    await self._resync()
                client = self._etcd._current()
                self._stream = await client.watch_prefix(
                    self.prefix.encode(), start_revision=self.last_revision + 1
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
            except RelayGRError as err:  # from a resync, which already failed over
                log.debug("etcd watch %r resync failed: %s", self.prefix, err)
            except (aetcd.ClientError, aetcd.rpc.BaseError, TimeoutError) as err:
                if client is not None and _unreachable(err):
                    await self._etcd._drop(client)
                else:
                    log.warning("etcd watch %r failed, re-creating: %s", self.prefix, err)
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
            # Best effort: unregister from aetcd's shared stream, which may already be closed.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stream.cancel(), timeout=1.0)
        self.connected = False

    async def cancel(self) -> None:
        """Stop delivering events."""
        await self._stop()
        self._etcd._forget(self)
