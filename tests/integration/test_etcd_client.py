"""EtcdClient against a real etcd: round trips, kept leases, watches, restarts and failover."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aetcd
import pytest

from relaygr.errors import ConfigError, Unavailable
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.errors import EtcdRejected
from relaygr.etcd.lease import Lease
from relaygr.etcd.watch import EventKind, WatchEvent
from tests.integration.etcd_faults import Flaky
from tests.integration.etcd_server import EtcdServer
from tests.polling import eventually

TTL_S = 2  # etcd's smallest lease TTL with default election settings


async def test_put_get_prefix_delete_round_trip(etcd_server: EtcdServer) -> None:
    client = EtcdClient([etcd_server.endpoint])
    try:
        first = await client.put("/t/rankers/a", b"alpha")
        second = await client.put("/t/rankers/b", b"beta")
        await client.put("/t/other", b"x")
        assert second > first
        assert await client.get("/t/rankers/a") == b"alpha"
        assert await client.get("/t/missing") is None
        values, revision = await client.get_prefix("/t/rankers/")
        assert values == {"/t/rankers/a": b"alpha", "/t/rankers/b": b"beta"}
        assert revision == second + 1
        assert await client.delete("/t/rankers/a") is True
        assert await client.delete("/t/rankers/a") is False
        assert await client.get("/t/rankers/a") is None
        assert (await client.get_prefix("/t/rankers/"))[0] == {"/t/rankers/b": b"beta"}
    finally:
        await client.close()


async def test_kept_lease_outlives_its_ttl_and_revoke_deletes_its_key(
    etcd_server: EtcdServer,
) -> None:
    client = EtcdClient([etcd_server.endpoint])
    leases: list[Lease] = []

    async def register(lease: Lease) -> None:
        leases.append(lease)
        await client.put("/t/rankers/r0", b"addr", lease)

    try:
        kept = await client.keep_lease(TTL_S, register)
        assert [lease.id for lease in leases] == [kept.lease_id]
        assert kept.connected
        # Waiting out the TTL twice is what is under test, not a readiness guess.
        await asyncio.sleep(2 * TTL_S + 0.5)
        assert await client.get("/t/rankers/r0") == b"addr"
        assert len(leases) == 1, "the lease was kept, not replaced"
        await kept.revoke()
        assert await client.get("/t/rankers/r0") is None
        assert kept.lease_id is None
    finally:
        await client.close()


async def test_key_vanishes_after_its_owner_stops_refreshing(etcd_server: EtcdServer) -> None:
    owner = EtcdClient([etcd_server.endpoint])
    observer = EtcdClient([etcd_server.endpoint])
    try:
        await owner.keep_lease(TTL_S, lambda lease: owner.put("/t/rankers/r1", b"a", lease))
        assert await observer.get("/t/rankers/r1") == b"a"
        stopped = time.monotonic()
        await owner.close()  # the owner dies: keepalives stop, nothing is revoked

        async def gone() -> bool:
            return await observer.get("/t/rankers/r1") is None

        await eventually(gone, "key deleted by lease expiry", timeout_s=TTL_S + 3)
        assert time.monotonic() - stopped > TTL_S / 2
    finally:
        await observer.close()


async def test_watch_delivers_initial_state_then_puts_and_deletes_in_order(
    etcd_server: EtcdServer,
) -> None:
    client = EtcdClient([etcd_server.endpoint])
    events: list[WatchEvent] = []
    try:
        start = await client.put("/t/dir/u0", b"r0")
        await client.put("/t/elsewhere", b"no")
        watch = await client.watch_prefix("/t/dir/", events.append)
        assert events == [WatchEvent(EventKind.PUT, "/t/dir/u0", b"r0", start + 1)]
        await client.put("/t/dir/u1", b"r1")
        await client.put("/t/dir/u0", b"r2")
        await client.delete("/t/dir/u1")
        await client.put("/t/elsewhere", b"still no")
        last = await client.delete("/t/dir/u0")
        assert last

        async def all_seen() -> bool:
            return len(events) >= 5

        await eventually(all_seen, "4 live events", timeout_s=5)
        assert [(e.kind, e.key, e.value) for e in events[1:]] == [
            (EventKind.PUT, "/t/dir/u1", b"r1"),
            (EventKind.PUT, "/t/dir/u0", b"r2"),
            (EventKind.DELETE, "/t/dir/u1", None),
            (EventKind.DELETE, "/t/dir/u0", None),
        ]
        revisions = [e.revision for e in events]
        assert revisions == sorted(revisions) and len(set(revisions)) == 5
        assert watch.last_revision == revisions[-1]
        await watch.cancel()
        await client.put("/t/dir/u2", b"after cancel")
        assert await client.get("/t/dir/u2") == b"after cancel"
        assert len(events) == 5
    finally:
        await client.close()


async def test_watch_from_a_compacted_revision_resyncs(etcd_server: EtcdServer) -> None:
    etcdctl = Path(etcd_server.binary).with_name("etcdctl")
    if not etcdctl.is_file():
        pytest.skip(f"no etcdctl next to {etcd_server.binary}")

    client = EtcdClient([etcd_server.endpoint])
    events: list[WatchEvent] = []
    try:
        await client.put("/t/dir/gone", b"x")
        await client.delete("/t/dir/gone")
        await client.put("/t/dir/kept", b"k")
        revision = await client.put("/t/other", b"o")
        compact = [str(etcdctl), f"--endpoints={etcd_server.endpoint}", "compact"]
        subprocess.run([*compact, str(revision)], check=True, capture_output=True, timeout=10)
        watch = await client.watch_prefix("/t/dir/", events.append, start_revision=1)

        async def synced() -> bool:
            return len(events) >= 1

        await eventually(synced, "resync after compaction", timeout_s=5)
        assert events == [WatchEvent(EventKind.PUT, "/t/dir/kept", b"k", revision)]
        await client.put("/t/dir/new", b"n")

        async def live() -> bool:
            return len(events) >= 2

        await eventually(live, "a live event after the resync", timeout_s=5)
        assert (events[1].kind, events[1].key) == (EventKind.PUT, "/t/dir/new")
        await watch.cancel()
    finally:
        await client.close()


async def test_a_lease_whose_re_registration_etcd_refuses_is_replaced_again(
    etcd_server: EtcdServer,
) -> None:
    """etcd refuses the owner's put under a replacement lease (it lapsed already): the keeper
    grants another and re-registers under it, rather than keep a lease that holds nothing."""
    client = Flaky([etcd_server.endpoint])
    leases: list[Lease] = []

    async def register(lease: Lease) -> None:
        leases.append(lease)
        if len(leases) == 2:
            raise EtcdRejected("etcd put: requested lease not found")
        await client.put("/t/rankers/r4", b"addr", lease)

    try:
        kept = await client.keep_lease(TTL_S, register)
        client.forget_next = True

        async def re_registered() -> bool:
            values, _ = await client.get_prefix("/t/rankers/")
            return len(leases) >= 3 and "/t/rankers/r4" in values and kept.lease is not None

        await eventually(re_registered, "a third lease carries the key", timeout_s=10)
        assert kept.lease_id == leases[2].id
    finally:
        await client.close()


async def test_a_keepalive_failing_unexpectedly_does_not_stop_the_keeper(
    etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever the client library raises in a keepalive, the keeper goes on refreshing: the key
    outlives the lease's TTL, and the failure is logged."""
    client = Flaky([etcd_server.endpoint])
    try:
        await client.keep_lease(TTL_S, lambda lease: client.put("/t/rankers/r5", b"a", lease))
        client.raise_next = RuntimeError("a client library's bug")
        await eventually(lambda: client.raise_next is None, "the keepalive raised", timeout_s=5)
        raised_at = client.refreshed
        # Refreshed again past the TTL after the failure: the keeper lives.
        await eventually(
            lambda: client.refreshed >= raised_at + 4, "the keeper refreshes again", timeout_s=10
        )
        assert await client.get("/t/rankers/r5") == b"a"
        assert "keepalive failed unexpectedly" in caplog.text
    finally:
        await client.close()


class ClosedUnderNextKeepalive(EtcdClient):
    """A real etcd client. Once asked, its next keepalive goes out to a stalled etcd (stopped
    with SIGSTOP, so the call stays in flight); another caller closes the channel under it, as a
    failover does, which gRPC answers by cancelling the call; then etcd resumes. `refreshed`
    counts keepalives that returned."""

    def __init__(self, endpoints: list[str], etcd_pid: int) -> None:
        super().__init__(endpoints)
        self._etcd_pid = etcd_pid
        self.close_under_next = False
        self.closed_under = 0
        self.refreshed = 0
        self._fail_over: asyncio.Task[None] | None = None

    async def refresh_lease(self, lease: Lease) -> bool:
        if self.close_under_next:
            self.close_under_next = False
            os.kill(self._etcd_pid, signal.SIGSTOP)
            # Runs once this task waits on the keepalive's reply, which etcd cannot send.
            asyncio.get_running_loop().call_soon(self._close_under_call, self.current())
        alive = await super().refresh_lease(lease)
        self.refreshed += 1
        return alive

    def _close_under_call(self, client: Any) -> None:
        async def fail_over() -> None:
            try:
                await client.close()
                self.closed_under += 1
            finally:
                os.kill(self._etcd_pid, signal.SIGCONT)

        self._fail_over = asyncio.ensure_future(fail_over())


async def test_a_keepalive_whose_channel_another_caller_closes_is_retried(
    etcd_server: EtcdServer,
) -> None:
    """gRPC cancels a call in flight when another caller's failover closes its channel: the call
    is tried again on a fresh channel, so the keeper goes on refreshing and its key outlives the
    TTL, rather than the keeper ending as if cancelled while `connected` still read True."""
    assert etcd_server.pid is not None
    client = ClosedUnderNextKeepalive([etcd_server.endpoint], etcd_server.pid)
    try:
        kept = await client.keep_lease(
            TTL_S, lambda lease: client.put("/t/rankers/r6", b"a", lease)
        )
        client.close_under_next = True
        await eventually(lambda: client.closed_under == 1, "the channel closed under a keepalive")
        closed_at = client.refreshed
        # Refreshed again past the TTL after the closing: the keeper lives.
        await eventually(
            lambda: client.refreshed >= closed_at + 4, "the keeper refreshes again", timeout_s=10
        )
        assert kept.connected and kept.lease_id is not None
        assert await client.get("/t/rankers/r6") == b"a"
    finally:
        os.kill(etcd_server.pid, signal.SIGCONT)
        await client.close()


class StuckConnection(EtcdClient):
    """A real etcd client whose first connection is stuck inside the client library: a put on
    it never returns (past any gRPC deadline) with `put_hangs`, else fails as unreachable; and
    closing it never returns."""

    def __init__(self, endpoints: list[str], put_hangs: bool) -> None:
        super().__init__(endpoints, request_timeout_s=0.5)
        self.stuck = True
        self._put_hangs = put_hangs

    def current(self) -> Any:
        if not self.stuck:
            return super().current()
        owner = self

        class Stuck:
            async def put(self, *args: object, **kwargs: object) -> None:
                owner.stuck = False  # the connection after this one is a real one
                if not owner._put_hangs:
                    raise aetcd.ConnectionFailedError()
                await asyncio.Event().wait()

            async def close(self) -> None:
                await asyncio.Event().wait()

        return Stuck()


@pytest.mark.parametrize("put_hangs", [True, False], ids=["call-hangs", "close-hangs"])
async def test_a_connection_stuck_in_the_client_library_holds_no_caller(
    etcd_server: EtcdServer, put_hangs: bool
) -> None:
    """A call held inside the client library past its deadline counts as unreachable, and the
    failed connection is closed without its caller waiting: the put lands over a fresh
    connection, and closing the client ends too. A lease keeper held so would lose its lease."""
    client = StuckConnection([etcd_server.endpoint], put_hangs)
    try:
        await asyncio.wait_for(client.put("/t/stuck", b"landed"), timeout=10)
        assert await client.get("/t/stuck") == b"landed"
    finally:
        await asyncio.wait_for(client.close(), timeout=10)


class BrokenWatchOnce(EtcdClient):
    """A real etcd client whose next watch stream fails once, raising `error` (None: it never
    starts, held inside the client library past any deadline)."""

    def __init__(self, endpoints: list[str], error: BaseException | None) -> None:
        super().__init__(endpoints, request_timeout_s=0.5)
        self.broken = True
        self._error = error

    def current(self) -> Any:
        if not self.broken:
            return super().current()
        self.broken = False
        error = self._error

        class Broken:
            async def watch_prefix(self, *args: object, **kwargs: object) -> None:
                if error is None:
                    await asyncio.Event().wait()
                else:
                    raise error

        return Broken()


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("a client library's bug"),  # an error no client library documents
        # What gRPC raises in a call it cancels when another caller's failover closes the
        # channel under it: not a cancellation of the watch.
        asyncio.CancelledError(),
        None,
    ],
    ids=["bug", "cancelled-call", "hangs"],
)
async def test_a_watch_failing_unexpectedly_is_re_created(
    etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture, error: BaseException | None
) -> None:
    """Whatever the client library raises, a watch goes on from its last revision: the change
    made after the failure is delivered, and a library's bug is logged."""
    client = BrokenWatchOnce([etcd_server.endpoint], error)
    events: list[WatchEvent] = []
    try:
        await client.watch_prefix("/t/watched/", events.append, start_revision=1)
        if isinstance(error, RuntimeError):
            await eventually(lambda: "failed unexpectedly" in caplog.text, "the failure logged")
        else:
            await eventually(lambda: not client.broken, "the broken stream handed out")
        await client.put("/t/watched/a", b"1")
        await eventually(lambda: [e.key for e in events] == ["/t/watched/a"], "the put seen")
    finally:
        await client.close()


async def test_lease_and_watch_recover_after_an_etcd_restart(etcd_server: EtcdServer) -> None:
    client = EtcdClient([etcd_server.endpoint])
    leases: list[Lease] = []
    events: list[WatchEvent] = []

    async def register(lease: Lease) -> None:
        leases.append(lease)
        await client.put("/t/rankers/r2", b"addr", lease)

    try:
        kept = await client.keep_lease(TTL_S, register)
        watch = await client.watch_prefix("/t/rankers/", events.append)

        async def watching() -> bool:
            return watch.connected

        await eventually(watching, "watch stream created", timeout_s=3)
        await asyncio.to_thread(etcd_server.stop)
        with pytest.raises(Unavailable, match=re.escape(etcd_server.endpoint)):
            await client.put("/t/rankers/x", b"lost")

        async def disconnected() -> bool:
            return not kept.connected and not watch.connected

        await eventually(disconnected, "lease and watch notice the outage", timeout_s=3)
        # The outage must outlast the TTL for the lease to count as lost.
        await asyncio.sleep(3.0)
        await asyncio.to_thread(etcd_server.start)

        async def re_registered() -> bool:
            if len(leases) < 2 or not kept.connected:
                return False
            values, _ = await client.get_prefix("/t/rankers/")
            return "/t/rankers/r2" in values

        await eventually(re_registered, "on_new_lease re-puts the key", timeout_s=10)
        assert kept.lease_id == leases[-1].id != leases[0].id
        await client.put("/t/rankers/r3", b"after restart")

        async def resumed() -> bool:
            return any(e.key == "/t/rankers/r3" for e in events)

        await eventually(resumed, "watch delivers a post-restart put", timeout_s=10)
        assert watch.connected
        revisions = [e.revision for e in events]
        assert revisions == sorted(set(revisions)), "in order, none repeated"
        assert [e.key for e in events].count("/t/rankers/r2") == 2  # initial + re-registered
        await watch.cancel()
        await kept.revoke()
        assert await client.get("/t/rankers/r2") is None
    finally:
        await client.close()


async def test_client_fails_over_to_the_next_endpoint(etcd_server: EtcdServer) -> None:
    client = EtcdClient(["127.0.0.1:1", etcd_server.endpoint])
    try:
        assert await client.connect() == etcd_server.endpoint
        await client.put("/t/failover", b"ok")
        assert await client.get("/t/failover") == b"ok"
    finally:
        await client.close()


async def test_no_endpoint_answering_raises_unavailable_naming_them() -> None:
    client = EtcdClient(["127.0.0.1:1", "127.0.0.1:2"], request_timeout_s=2.0)
    try:
        with pytest.raises(Unavailable, match=re.escape("127.0.0.1:1, 127.0.0.1:2")):
            await client.get("/t/anything")
    finally:
        await client.close()


def test_bad_endpoints_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        EtcdClient(["etcd-0"])
    with pytest.raises(ConfigError, match="at least one"):
        EtcdClient([])
