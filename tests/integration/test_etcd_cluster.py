"""EtcdMembershipDirectory on a real etcd: two processes' views, lease expiry, an outage, writes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import NamedTuple

import pytest

from relaygr.cluster import PlacementRecord, RankerRecord
from relaygr.errors import Unavailable
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.errors import EtcdRejected
from relaygr.etcd.lease import Lease
from relaygr.etcd.membership_directory import EtcdMembershipDirectory
from tests.integration.etcd_faults import Flaky
from tests.integration.etcd_server import EtcdServer
from tests.polling import eventually

TTL_S = 2  # etcd's smallest lease TTL with default election settings
DIRECTORY = "/relaygr/directory/"
MV = "v1"  # every ranker's model version here


def ranker(instance_id: str) -> RankerRecord:
    return RankerRecord(
        instance_id=instance_id,
        address=f"{instance_id}.rankers:50051",
        model_version=MV,
        hbm_budget_bytes=1 << 30,
        dram_budget_bytes=1 << 32,
        kv_bytes_per_token=2048,
        fixed_ms=2.0,
        per_token_ms=0.01,
        per_pair_ms=0.001,
        per_candidate_key_ms=0.002,
        reload_ms_per_mb=0.1,
    )


class Clock:
    """A wall clock the test sets."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Processes(NamedTuple):
    """Two processes' directories on one etcd, each with its own client: a ranker's first."""

    ranker: EtcdMembershipDirectory
    router: EtcdMembershipDirectory
    ranker_client: EtcdClient
    router_client: EtcdClient


@contextlib.asynccontextmanager
async def two_processes(
    etcd_server: EtcdServer,
    clock: Callable[[], float] = time.time,
    ranker_client: EtcdClient | None = None,
) -> AsyncIterator[Processes]:
    """A ranker's and a router's directory on `etcd_server` (the ranker's over `ranker_client`,
    if given), stopped and disconnected after."""
    endpoints = [etcd_server.endpoint]
    ranker_client = ranker_client or EtcdClient(endpoints)
    router_client = EtcdClient(endpoints)
    ranker_side = EtcdMembershipDirectory(ranker_client, clock=clock)
    router_side = EtcdMembershipDirectory(router_client, clock=clock)
    try:
        yield Processes(ranker_side, router_side, ranker_client, router_client)
    finally:
        await ranker_side.stop()
        await router_side.stop()
        await ranker_client.close()
        await router_client.close()


async def test_two_clusters_share_membership_and_directory(etcd_server: EtcdServer) -> None:
    clock = Clock(1000.0)
    async with two_processes(etcd_server, clock) as p:
        ranker_side, router_side, router_client = p.ranker, p.router, p.router_client
        # Malformed values are skipped, before and after the watches start.
        await router_client.put("/relaygr/rankers/bad", b"{not json")
        await ranker_side.start()
        await router_side.start()
        await router_client.put(DIRECTORY + "v1/bad", b"[]")
        await ranker_side.register(ranker("r0"), TTL_S)
        await ranker_side.register(ranker("r1"), TTL_S)
        await eventually(lambda: set(router_side.view()) == {"r0", "r1"}, "both rankers seen")
        assert router_side.view()["r1"] == ranker("r1")
        snapshot = router_side.view()

        # r0 holds (its lease carries) a placement on r1: a spill-over.
        assert await router_side.record(PlacementRecord("u1", "r1", 1010.0, MV), "r0")
        assert router_side.lookup("u1", MV) == "r1"  # the writer sees its own record at once
        await eventually(lambda: ranker_side.lookup("u1", MV) == "r1", "seen on the other side")
        assert not await router_side.record(PlacementRecord("u2", "r1", 1010.0, MV), "ghost")
        assert router_side.lookup("u2", MV) is None
        assert router_side.lookup("bad", MV) is None

        clock.now = 1010.0
        assert router_side.lookup("u1", MV) is None and ranker_side.lookup("u1", MV) is None
        clock.now = 1009.9
        assert router_side.lookup("u1", MV) == "r1"

        await ranker_side.deregister("r0")
        await eventually(lambda: set(router_side.view()) == {"r1"}, "r0 leaves the other view")
        assert set(snapshot) == {"r0", "r1"}, "a view is a snapshot"
        assert router_side.lookup("u1", MV) is None, "the entry went with its holder"
        assert (await router_client.get_prefix(DIRECTORY))[0].keys() == {DIRECTORY + "v1/bad"}


async def test_a_dead_rankers_record_and_entries_vanish_within_its_ttl(
    etcd_server: EtcdServer,
) -> None:
    endpoints = [etcd_server.endpoint]
    ranker_client, router_client = EtcdClient(endpoints), EtcdClient(endpoints)
    ranker_side = EtcdMembershipDirectory(ranker_client)
    router_side = EtcdMembershipDirectory(router_client)
    try:
        await router_side.start()
        await ranker_side.register(ranker("r0"), TTL_S)
        await ranker_side.register(ranker("r1"), TTL_S)
        await eventually(lambda: set(router_side.view()) == {"r0", "r1"}, "rankers seen")
        expires_at = time.time() + 60
        assert await router_side.record(PlacementRecord("u0", "r0", expires_at, MV), "r0")
        assert await router_side.record(PlacementRecord("u1", "r1", expires_at, MV), "r1")

        await ranker_client.close()  # the rankers' process dies: no keepalive, no revoke
        await router_side.deregister("r0")  # not registered by the router: left alone
        died = time.monotonic()
        await eventually(lambda: set(router_side.view()) == set(), "dead rankers leave", TTL_S + 2)
        # etcd checks expiry every 0.5 s; the last keepalive may have been TTL/3 before.
        assert time.monotonic() - died < TTL_S + 1.0
        assert router_side.lookup("u0", MV) is None and router_side.lookup("u1", MV) is None
        assert (await router_client.get_prefix(DIRECTORY))[0] == {}
    finally:
        await router_side.stop()
        await router_client.close()


async def test_an_etcd_outage_keeps_the_views_and_recovers(etcd_server: EtcdServer) -> None:
    async with two_processes(etcd_server) as p:
        ranker_side, router_side, router_client = p.ranker, p.router, p.router_client
        await ranker_side.start()
        await router_side.start()
        await ranker_side.register(ranker("r0"), TTL_S)
        await eventually(lambda: "r0" in router_side.view(), "r0 seen")
        assert await router_side.record(PlacementRecord("u1", "r0", time.time() + 60, MV), "r0")

        await asyncio.to_thread(etcd_server.stop)
        stopped = time.monotonic()
        assert set(router_side.view()) == {"r0"} and router_side.lookup("u1", MV) == "r0"
        with pytest.raises(Unavailable):
            await router_side.record(PlacementRecord("u2", "r0", time.time() + 60, MV), "r0")
        with pytest.raises(Unavailable):
            await ranker_side.register(ranker("r1"), TTL_S)
        with pytest.raises(Unavailable):
            await router_side.forget_instance("r0")
        # The outage itself is under test: it outlasts the TTL, so r0's lease counts as lost.
        await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - stopped)))
        assert set(router_side.view()) == {"r0"} and router_side.lookup("u1", MV) == "r0"
        await asyncio.to_thread(etcd_server.start)

        async def r0_in_etcd() -> bool:
            try:
                values, _ = await router_client.get_prefix("/relaygr/rankers/")
            except Unavailable:  # the client's channels may lag the restart briefly
                return False
            return "/relaygr/rankers/r0" in values

        await eventually(r0_in_etcd, "r0 still or again registered", timeout_s=10)
        await eventually(lambda: "r0" in router_side.view(), "r0 in the view")

        # A record may still go under r0's pre-outage lease (which etcd restored and then lets
        # lapse, as r0 moved to a new one): repeat it until the other side sees it.
        placement = PlacementRecord("u2", "r0", time.time() + 60, MV)

        async def recorded_and_seen() -> bool:
            if ranker_side.lookup("u2", MV) == "r0":
                return True
            with contextlib.suppress(Unavailable):
                await router_side.record(placement, "r0")
            return False

        await eventually(recorded_and_seen, "a post-outage record seen", timeout_s=10)
        await ranker_side.register(ranker("r1"), TTL_S)
        await eventually(lambda: "r1" in router_side.view(), "a post-outage ranker seen")


class HeldPut(EtcdClient):
    """A real etcd client whose first put under `held_lease` waits until `release` is set, and
    which tells when it granted a lease and when a put under another lease was on its way."""

    def __init__(self, endpoints: list[str]) -> None:
        super().__init__(endpoints)
        self.held_lease: int | None = None
        self.held, self.release, self.granted = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.others_on_their_way = 0
        self.other_landed = asyncio.Event()

    async def grant_lease(self, ttl_s: int) -> Lease:
        lease = await super().grant_lease(ttl_s)
        self.granted.set()
        return lease

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        if lease is not None and lease.id == self.held_lease:
            self.held_lease = None
            self.held.set()
            await self.release.wait()
            return await super().put(key, value, lease)
        self.others_on_their_way += 1
        try:
            return await super().put(key, value, lease)
        finally:
            self.others_on_their_way -= 1
            self.other_landed.set()


@pytest.mark.parametrize("lands", ["before the old lease lapses", "after the old lease lapsed"])
async def test_a_record_put_while_its_lease_is_replaced_stays_registered(
    etcd_server: EtcdServer, lands: str
) -> None:
    """A ranker republishes its record (a refitted cost model) under its lease just as an etcd
    outage past the TTL makes the lease keeper replace that lease. Whatever order the two puts
    were sent in, the record ends up under the kept lease, with the newest values: it outlives
    the old lease, which etcd restored at its restart and then lets lapse. A republish that
    reaches etcd once the old lease is gone is no error: the new lease's put carries it."""
    held = HeldPut([etcd_server.endpoint])
    key = "/relaygr/rankers/r0"
    async with two_processes(etcd_server, ranker_client=held) as p:
        ranker_side, router_side, router_client = p.ranker, p.router, p.router_client
        try:
            await router_side.start()
            await ranker_side.register(ranker("r0"), TTL_S)
            old = await lease_of(router_client, "r0")
            assert old is not None
            held.held_lease = old
            refitted = replace(ranker("r0"), fixed_ms=3.0)
            republish = asyncio.create_task(ranker_side.register(refitted, TTL_S))
            await asyncio.wait_for(held.held.wait(), timeout=10)  # sent under the old lease

            await asyncio.to_thread(etcd_server.stop)
            held.granted.clear()
            # The outage itself is under test: it outlasts the TTL, so the lease counts as lost.
            await asyncio.sleep(TTL_S + 1.0)
            await asyncio.to_thread(etcd_server.start)
            await asyncio.wait_for(held.granted.wait(), timeout=15)  # the keeper's new lease
            # A put the new lease sent at once (in the step that granted it) lands first; then the
            # held one goes on.
            if held.others_on_their_way:
                held.other_landed.clear()
                await asyncio.wait_for(held.other_landed.wait(), timeout=10)

            def old_lease_lapsed() -> Awaitable[bool]:
                return lapsed(router_client, old)

            if lands == "after the old lease lapsed":
                await eventually(old_lease_lapsed, "the old lease lapsed", timeout_s=15)
            held.release.set()
            await asyncio.wait_for(republish, timeout=10)  # raises what the republish raised
            await eventually(old_lease_lapsed, "the old lease lapsed", timeout_s=15)

            async def newest_record_under_another_lease() -> bool:
                values, _ = await router_client.get_prefix("/relaygr/rankers/")
                stored = json.loads(values[key]) if key in values else {}
                return stored.get("lease") not in (None, old) and stored.get("fixed_ms") == 3.0

            # Gone for good if it went with the old lease: its keeper renews the new one only.
            await eventually(
                newest_record_under_another_lease, "the newest record under a kept lease"
            )
            await eventually(
                lambda: router_side.view().get("r0") == refitted, "the newest record in the view"
            )
        finally:
            held.release.set()  # a held put must not outlive the test


async def test_a_rankers_record_deleted_behind_its_back_is_put_back(
    etcd_server: EtcdServer,
) -> None:
    """An operator's delete (or anything else) takes a serving ranker's record out of etcd: the
    ranker sees it through its watch and puts it back under the lease it keeps."""
    async with two_processes(etcd_server) as p:
        ranker_side, router_side, router_client = p.ranker, p.router, p.router_client
        await ranker_side.start()
        await router_side.start()
        await ranker_side.register(ranker("r0"), TTL_S)
        key = "/relaygr/rankers/r0"
        lease = await lease_of(router_client, "r0")
        assert lease is not None and await router_client.delete(key)

        async def back_under_its_lease() -> bool:
            return await lease_of(router_client, "r0") == lease

        await eventually(back_under_its_lease, "the record put back under the kept lease")
        await eventually(lambda: router_side.view().get("r0") == ranker("r0"), "r0 seen again")
        await ranker_side.deregister("r0")
        await eventually(lambda: "r0" not in router_side.view(), "a deregistration stays")
        assert await router_client.get(key) is None


async def test_a_record_left_under_a_replaced_lease_moves_to_the_kept_one(
    etcd_server: EtcdServer,
) -> None:
    """A put of the ranker's record lands under a lease its keeper has just replaced (the old
    lease still lives for a TTL, as after an etcd restart): the ranker sees it through its
    watch and moves the record to the kept lease, so it outlives the old one."""
    key = "/relaygr/rankers/r0"
    flaky = Flaky([etcd_server.endpoint])
    async with two_processes(etcd_server, ranker_client=flaky) as p:
        ranker_side, router_side, router_client = p.ranker, p.router, p.router_client
        await ranker_side.start()
        await router_side.start()
        await ranker_side.register(ranker("r0"), TTL_S)
        old = await lease_of(router_client, "r0")
        assert old is not None
        flaky.forget_next = True

        async def replaced() -> bool:
            return await lease_of(router_client, "r0") not in (None, old)

        await eventually(replaced, "the keeper's new lease carries the record")
        new = await lease_of(router_client, "r0")
        # The late put under the old lease, which etcd holds for up to a TTL more.
        stale = _with_lease(ranker("r0"), old)
        await router_client.put(key, stale, Lease(id=old, ttl_s=0))

        await eventually(
            lambda: lapsed(router_client, old), "the old lease lapsed", timeout_s=TTL_S + 3
        )
        assert await lease_of(router_client, "r0") == new
        assert "r0" in router_side.view()


async def test_a_record_deleted_again_as_it_is_put_back_is_put_back_again(
    etcd_server: EtcdServer,
) -> None:
    """The record is deleted again right after each of the ranker's puts that restore it lands
    (before the put returns): the ranker goes on putting it back until one stays."""
    key = "/relaygr/rankers/r0"
    flaky = Flaky([etcd_server.endpoint])
    async with two_processes(etcd_server, ranker_client=flaky) as p:
        ranker_side, router_client = p.ranker, p.router_client
        await ranker_side.start()
        await ranker_side.register(ranker("r0"), TTL_S)
        lease = await lease_of(router_client, "r0")
        flaky.delete_after_put = (key, 3)
        assert await router_client.delete(key)

        async def back_for_good() -> bool:
            return flaky.deleted_after_put == 3 and await lease_of(router_client, "r0") == lease

        await eventually(back_for_good, "the record put back after three deletes")


async def test_another_process_registering_the_same_instance_id_is_reported_not_fought(
    etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Two processes given one instance id: the first sees its record put under a lease it never
    held, logs the misconfiguration, and leaves the record alone (no put war)."""
    async with two_processes(etcd_server) as p:
        ranker_side, router_client = p.ranker, p.router_client
        await ranker_side.start()
        await ranker_side.register(ranker("r0"), TTL_S)
        puts = ranker_side.writes["put"]
        theirs = await router_client.grant_lease(60)
        key = "/relaygr/rankers/r0"
        await router_client.put(key, _with_lease(ranker("r0"), theirs.id), theirs)
        await eventually(
            lambda: "registered by another process too" in caplog.text, "the clash reported"
        )
        assert ranker_side.writes["put"] == puts
        assert await lease_of(router_client, "r0") == theirs.id
        await router_client.revoke_lease(theirs)


async def lease_of(client: EtcdClient, instance_id: str) -> int | None:
    """The lease `instance_id`'s record is put under in etcd (None: no record)."""
    value = await client.get(f"/relaygr/rankers/{instance_id}")
    return None if value is None else int(json.loads(value)["lease"])


async def lapsed(client: EtcdClient, lease_id: int) -> bool:
    """Whether etcd no longer knows `lease_id` (a put under it is refused)."""
    try:
        await client.put("/relaygr/probe", b"", Lease(id=lease_id, ttl_s=0))
    except EtcdRejected:  # lease not found
        return True
    except Unavailable:  # the client's channels may lag a restart briefly
        return False
    return False


def _with_lease(record: RankerRecord, lease_id: int) -> bytes:
    """`record` as a ranker puts it in etcd, under `lease_id`."""
    return json.dumps({**json.loads(record.to_json()), "lease": lease_id}).encode()


async def test_a_ranker_deregistered_while_registering_is_not_left_registered(
    etcd_server: EtcdServer,
) -> None:
    """A drain that begins during start-up (SIGTERM while the first lease is granted): the
    registration finishes without error and leaves no record and no kept lease behind; the
    instance can register again afterwards."""
    async with two_processes(etcd_server) as p:
        ranker_side, router_side, router_client = p.ranker, p.router, p.router_client
        await router_side.start()
        registering = asyncio.create_task(ranker_side.register(ranker("r0"), TTL_S))
        await asyncio.sleep(0)  # the registration is now waiting on its lease's grant
        assert not registering.done()
        await ranker_side.deregister("r0")
        await asyncio.wait_for(registering, timeout=10)  # raises what the registration raised
        assert await router_client.get("/relaygr/rankers/r0") is None
        assert ranker_side.writes["lease_grant"] == ranker_side.writes["lease_revoke"] == 1
        assert ranker_side.writes["put"] == 0

        await ranker_side.register(ranker("r0"), TTL_S)
        await eventually(lambda: "r0" in router_side.view(), "r0 registered again")
        await ranker_side.deregister("r0")
        await eventually(lambda: "r0" not in router_side.view(), "r0 gone again")


async def test_entries_seen_through_the_watch_share_their_ranker_and_version_names(
    etcd_server: EtcdServer,
) -> None:
    """A router holds an entry per user placed off its owner (millions in a large fleet); the
    few ranker ids and model versions they name are held once, not once per entry."""
    async with two_processes(etcd_server) as p:
        ranker_side, router_side = p.ranker, p.router
        await router_side.start()
        await ranker_side.start()
        await ranker_side.register(ranker("r0"), TTL_S)
        await ranker_side.register(ranker("r1"), TTL_S)
        await eventually(lambda: set(router_side.view()) == {"r0", "r1"}, "rankers seen")
        expires_at = time.time() + 60
        for user in ("u1", "u2"):
            assert await ranker_side.record(PlacementRecord(user, "r1", expires_at, MV), "r0")
        seen = [lambda: router_side.entry("u1", MV), lambda: router_side.entry("u2", MV)]
        await eventually(lambda: all(e() is not None for e in seen), "both entries seen")
        first, second = (e() for e in seen)
        assert first is not None and second is not None
        assert (
            (first.instance_id, first.model_version)
            == ("r1", MV)
            == (
                second.instance_id,
                second.model_version,
            )
        )
        assert first.instance_id is second.instance_id
        assert first.model_version is second.model_version


async def test_writes_count_puts_deletes_and_leases_not_lookups(etcd_server: EtcdServer) -> None:
    clock = Clock(1000.0)
    client = EtcdClient([etcd_server.endpoint])
    cluster = EtcdMembershipDirectory(client, prefix="/other/", clock=clock)
    try:
        await cluster.start()
        await cluster.register(ranker("r0"), TTL_S)
        assert cluster.writes == {"lease_grant": 1, "put": 1}
        await eventually(lambda: "r0" in cluster.view(), "r0 seen")
        for i in range(5):
            placement = PlacementRecord(f"u{i}", "r0", 1010.0 if i < 2 else 1100.0, MV)
            assert await cluster.record(placement, "r0")
        assert not await cluster.record(PlacementRecord("u9", "r0", 1100.0, MV), "ghost")
        for _ in range(1000):
            assert cluster.lookup("u4", MV) == "r0"
        assert cluster.writes == {"lease_grant": 1, "put": 6}
        values, _ = await client.get_prefix("/other/directory/")
        assert len(values) == 5

        clock.now = 1050.0
        assert await cluster.purge_expired() == 2
        await cluster.forget_instance("r0")
        assert cluster.writes == {"lease_grant": 1, "put": 6, "delete": 5}
        assert (await client.get_prefix("/other/directory/"))[0] == {}
        await cluster.deregister("r0")
        assert cluster.writes == {"lease_grant": 1, "put": 6, "delete": 5, "lease_revoke": 1}
        assert await client.get("/other/rankers/r0") is None
    finally:
        await cluster.stop()
        await client.close()


async def test_directory_entries_are_namespaced_by_model_version(etcd_server: EtcdServer) -> None:
    clock = Clock(1000.0)
    async with two_processes(etcd_server, clock) as (writer, reader, writer_client, reader_client):
        await writer.start()
        await reader.start()
        await writer.register(ranker("r0"), TTL_S)
        await writer.register(ranker("r1"), TTL_S)
        await eventually(lambda: set(reader.view()) == {"r0", "r1"}, "rankers seen")
        # An older router's unversioned entry is never found under any version.
        await writer_client.put(DIRECTORY + "u1", PlacementRecord("u1", "r0", 1100.0).to_json())
        assert await writer.record(PlacementRecord("u1", "r0", 1100.0, "v1"), "r0")
        assert await writer.record(PlacementRecord("u1", "r1", 1100.0, "v2"), "r1")
        await eventually(lambda: reader.lookup("u1", "v2") == "r1", "the v2 entry seen")
        assert reader.lookup("u1", "v1") == "r0" and reader.lookup("u1", "") is None
        assert reader.lookup("u1", "v3") is None
        keys = (await reader_client.get_prefix(DIRECTORY))[0].keys()
        assert keys == {DIRECTORY + "u1", DIRECTORY + "v1/u1", DIRECTORY + "v2/u1"}
        await writer.forget_instance("r1")  # the v2 entry goes, the v1 entry stays
        await eventually(lambda: reader.lookup("u1", "v2") is None, "the v2 entry gone")
        assert reader.lookup("u1", "v1") == "r0"
