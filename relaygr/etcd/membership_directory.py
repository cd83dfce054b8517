"""The etcd implementation of the Membership and Directory ports, served from watched views."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import types
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from relaygr.aio import cancel_and_wait
from relaygr.cluster import PlacementRecord, RankerRecord
from relaygr.errors import InvalidInput, RelayGRError
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.errors import EtcdRejected
from relaygr.etcd.lease import KeptLease, Lease
from relaygr.etcd.retry import Backoff
from relaygr.etcd.watch import EventKind, Watch, WatchEvent
from relaygr.json_object import json_object

log = logging.getLogger(__name__)


_Key = tuple[str, str]  # a directory entry's (model version, user id)
_NAMES_KEPT = 4096  # distinct ranker ids and model versions whose strings entries share


@dataclass(frozen=True, slots=True)
class _Entry:
    """A directory entry as last seen, with the store revision it was written at."""

    placement: PlacementRecord
    holder: str
    revision: int


class EtcdMembershipDirectory:
    """The `Membership` and `Directory` ports (see `relaygr.cluster`) kept in etcd under `prefix`.

    One class for both ports: a directory entry lives under its holder's membership lease and
    dies with it, so the two share the rankers view and the leases seen in it.

    Keys: `{prefix}/rankers/{instance_id}` holds the RankerRecord JSON plus `"lease"`, the id of
    the lease it is put under (kept alive by the registering process);
    `{prefix}/directory/{model_version}/{user}` holds the PlacementRecord JSON plus `"holder"`,
    put under the holder ranker's lease, so an entry dies with its holder. Versions contain no
    "/", so the key's first segment after `directory/` is the version. An entry an older router
    wrote without a version (`{prefix}/directory/{user}`) is ignored: it is never consumed under
    any version, dies with its holder's lease, and its writer purges it.

    Invariants: `view()` and `lookup()` read only the local views, which two watches (rankers,
    directory) maintain from `start()` to `stop()`; they never do I/O. The rankers view is replaced,
    never mutated, so a `view()` snapshot is stable. A ranker leaving the view drops, at once, the
    local directory entries it holds or is named in; `lookup` also answers None unless both the
    named instance and the holder are in the view and `clock() < expires_at`. A directory entry is
    never replaced by an event older than the revision it was last written at (`record` updates
    the local view as soon as etcd acknowledges). Malformed values are logged and treated as
    absent. While etcd is down the views stay as last seen and every method that writes raises
    `Unavailable` (except `deregister`, whose lease then lapses within its TTL); watches and kept
    leases resume by themselves. Once started, the rankers watch also guards the records
    registered here: one seen deleted, or under a lease granted here but no longer kept, is put
    back under the kept lease (`_owned_record_seen`). `writes` counts etcd write requests that
    succeeded: "put", "delete", "lease_grant", "lease_revoke".
    """

    def __init__(
        self,
        etcd: EtcdClient,
        *,
        prefix: str = "/relaygr",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._etcd = etcd
        self._clock = clock
        self._rankers_prefix = f"{prefix.rstrip('/')}/rankers/"
        self._directory_prefix = f"{prefix.rstrip('/')}/directory/"
        self._rankers: dict[str, RankerRecord] = {}
        self._view = types.MappingProxyType(self._rankers)
        self._leases: dict[str, int] = {}  # instance id -> lease id of its record, as last seen
        self._entries: dict[_Key, _Entry] = {}  # (model version, user id) -> entry
        self._recorded: set[_Key] = set()  # entries this process last wrote
        self._names: dict[str, str] = {}  # one string per ranker id or version entries name
        self._owned: dict[str, tuple[RankerRecord, KeptLease | None]] = {}
        # One per owned instance: its record's puts go one at a time (see `register`).
        self._puts: dict[str, asyncio.Lock] = {}
        # Leases granted here, by owned instance; and the puts restoring an owned record the
        # watch saw gone or under one of them no longer kept (see `_owned_record_seen`).
        self._granted: dict[str, set[int]] = {}
        self._restoring: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()  # seen wrong again while their restoring put was on its way
        self._watches: list[Watch] = []
        self.writes: Counter[str] = Counter()
        # When a ranker last joined or left the view (`clock` seconds); its start counts.
        self.members_changed_at = clock()

    async def start(self) -> None:
        """Load both views afresh and follow changes; raises `Unavailable` if etcd is down."""
        self._rankers, self._leases, self._entries = {}, {}, {}
        self._view = types.MappingProxyType(self._rankers)
        # Rankers first, so the initial directory entries find their holders in the view.
        for prefix, on_event in (
            (self._rankers_prefix, self._on_ranker_event),
            (self._directory_prefix, self._on_directory_event),
        ):
            try:
                self._watches.append(await self._etcd.watch_prefix(prefix, on_event))
            except BaseException:
                await self.stop()
                raise

    async def stop(self) -> None:
        """Stop following etcd; registered leases are kept (the EtcdClient's `close` ends them)."""
        watches, self._watches = self._watches, []
        for watch in watches:
            await watch.cancel()
        await cancel_and_wait(*self._restoring.values())

    # Membership

    async def register(self, record: RankerRecord, ttl_s: float) -> None:
        """Put `record` under a kept lease of `ttl_s` (rounded up to whole seconds).

        Registering an instance again replaces its record under the lease it already has.
        """
        if not ttl_s > 0:
            raise InvalidInput(f"lease ttl_s must be positive, got {ttl_s}")
        instance_id = record.instance_id
        if instance_id in self._owned:
            self._owned[instance_id] = (record, self._owned[instance_id][1])
            await self._put_owned(instance_id)
            return

        # This registration's lock: a deregister (a drain begun during start-up) drops it, and
        # a put or a lease that finds it gone belongs to a registration no longer wanted.
        puts = asyncio.Lock()

        def current() -> bool:
            return self._puts.get(instance_id) is puts

        async def on_new_lease(lease: Lease) -> None:
            self.writes["lease_grant"] += 1
            if current():
                self._granted.setdefault(instance_id, set()).add(lease.id)
            async with puts:
                if current():
                    await self._put_ranker(self._owned[instance_id][0], lease)

        self._owned[instance_id] = (record, None)
        self._puts[instance_id] = puts
        try:
            kept = await self._etcd.keep_lease(math.ceil(ttl_s), on_new_lease)
        except BaseException:
            if current():
                del self._owned[instance_id], self._puts[instance_id]
            raise
        if not current():  # deregistered while the lease was granted: take it back
            await self._revoke(kept)
            return
        self._owned[instance_id] = (self._owned[instance_id][0], kept)

    async def deregister(self, instance_id: str) -> None:
        """Revoke the instance's lease, deleting its record and the entries it holds.

        Only an instance registered here can be deregistered; others are left alone. If etcd is
        down the lease is no longer kept and lapses within its TTL.
        """
        record_and_kept = self._owned.pop(instance_id, None)
        self._puts.pop(instance_id, None)  # a put waiting on it finds the instance gone
        self._granted.pop(instance_id, None)
        await cancel_and_wait(self._restoring.pop(instance_id, None))
        self._again.discard(instance_id)
        if record_and_kept is None or record_and_kept[1] is None:
            return
        await self._revoke(record_and_kept[1])

    async def _put_owned(self, instance_id: str) -> None:
        """Put the newest record of an instance registered here under the lease kept now.

        After any put of the record still on its way (a new lease's), and under the lease kept
        once it landed: a put sent under a lease the keeper has since replaced would land after
        the new lease's put and tie the record to the old lease, which etcd lets lapse (after an
        outage it restores the old lease for one more TTL), taking the record, and the ranker,
        out of every view until its next put. Nothing to do while no lease is kept (the coming
        replacement puts the newest record) or once the instance is deregistered.
        """
        puts = self._puts.get(instance_id)
        if puts is None:
            return
        async with puts:
            kept, lease = self._kept(instance_id)
            if kept is None or lease is None:
                return
            try:
                await self._put_ranker(self._owned[instance_id][0], lease)
            except EtcdRejected:
                if kept.lease is lease:
                    raise
                # The lease lapsed while the put was on its way, and the keeper replaced it:
                # the new lease's put carries this record.

    def _kept(self, instance_id: str) -> tuple[KeptLease | None, Lease | None]:
        """The lease keeper of an instance registered here, and the lease it keeps now (None:
        not registered, still registering, or a lost lease awaiting replacement)."""
        kept = self._owned[instance_id][1] if instance_id in self._owned else None
        return kept, None if kept is None else kept.lease

    def _owned_record_seen(self, instance_id: str, lease_id: int | None) -> None:
        """The watch saw the record of an instance registered here put under `lease_id` (None:
        deleted). If it is gone, or under a lease granted here but no longer kept, put it back
        under the lease kept now: whatever took it (a put that raced a lease replacement, a
        lapsed lease, an operator's delete), a ranker that serves stays in every view without
        waiting for its next put. A lease granted elsewhere is another process registering the
        same instance id: a misconfiguration reported, never fought over."""
        _, lease = self._kept(instance_id)
        if lease is None or lease.id == lease_id:
            return
        running = self._restoring.get(instance_id)
        if running is not None and not running.done():
            self._again.add(instance_id)  # its put may have landed before this change
            return
        if lease_id is not None and lease_id not in self._granted.get(instance_id, ()):
            log.error(
                "instance id %s is registered by another process too (lease %d, not ours):"
                " give each ranker its own instance id",
                instance_id,
                lease_id,
            )
            return
        log.warning(
            "the record of %s is %s in etcd: putting it back under lease %d",
            instance_id,
            "gone" if lease_id is None else f"under lapsing lease {lease_id}",
            lease.id,
        )
        task = asyncio.get_running_loop().create_task(
            self._restore(instance_id), name=f"etcd-restore-{instance_id}"
        )
        self._restoring[instance_id] = task

        def done(finished: asyncio.Task[None]) -> None:
            if self._restoring.get(instance_id) is finished:
                del self._restoring[instance_id]

        task.add_done_callback(done)

    async def _restore(self, instance_id: str) -> None:
        backoff = Backoff()
        while True:
            self._again.discard(instance_id)
            try:
                await self._put_owned(instance_id)
                if instance_id not in self._again:
                    return
                continue  # the record changed again while this put was on its way
            except RelayGRError as err:  # etcd down, or the lease lapsed: its keeper replaces it
                log.info("putting back the record of %s failed, retrying: %s", instance_id, err)
            await backoff.sleep()

    async def _revoke(self, kept: KeptLease) -> None:
        if kept.lease is not None:
            self.writes["lease_revoke"] += 1
        await kept.revoke()

    def view(self) -> Mapping[str, RankerRecord]:
        return self._view

    # Directory

    async def record(self, placement: PlacementRecord, holder_instance_id: str) -> bool:
        """Put `placement` under the holder's lease; False if the holder is not a live member."""
        lease_id = self._leases.get(holder_instance_id)
        if lease_id is None:
            return False
        data = entry_value(placement, holder_instance_id)
        entry_key = (placement.model_version, placement.user_id)
        key = self._directory_key(entry_key)
        try:
            # put sends only the lease id; the TTL is the holder's business.
            revision = await self._etcd.put(key, data, Lease(id=lease_id, ttl_s=0))
        except EtcdRejected as err:  # the holder's lease lapsed before the view saw it go
            log.info("placement of %s not recorded: %s", placement.user_id, err)
            return False
        self.writes["put"] += 1
        self._recorded.add(entry_key)
        self._apply(entry_key, _Entry(placement, holder_instance_id, revision), revision)
        return True

    def entry(self, user_id: str, model_version: str) -> PlacementRecord | None:
        entry = self._entries.get((model_version, user_id))
        if entry is None or self._clock() >= entry.placement.expires_at:
            return None
        if entry.placement.instance_id not in self._rankers or entry.holder not in self._rankers:
            return None
        return entry.placement

    def lookup(self, user_id: str, model_version: str) -> str | None:
        placement = self.entry(user_id, model_version)
        return None if placement is None else placement.instance_id

    async def forget_instance(self, instance_id: str) -> None:
        """Delete every entry held by or placed on the instance, in etcd and locally."""
        keys = [
            key
            for key, entry in self._entries.items()
            if instance_id in (entry.holder, entry.placement.instance_id)
        ]
        for key in keys:
            await self._etcd.delete(self._directory_key(key))
            self.writes["delete"] += 1
            self._entries.pop(key, None)

    async def purge_expired(self, others_after_s: float = math.inf) -> int:
        """Delete expired entries from etcd (their holder's lease outlives them); return how many.

        Deletes the expired entries this process recorded, and those recorded elsewhere that
        expired more than `others_after_s` ago (left by a writer that is gone). Each router
        purging its own keeps etcd's directory as large as the live placements, and deletes do
        not repeat across routers. Writes follow placements, not requests.
        """
        now = self._clock()
        self._recorded.intersection_update(self._entries)  # forget entries gone otherwise
        keys = [
            key
            for key, entry in self._entries.items()
            if now >= entry.placement.expires_at
            and (key in self._recorded or now >= entry.placement.expires_at + others_after_s)
        ]
        for key in keys:
            await self._etcd.delete(self._directory_key(key))
            self.writes["delete"] += 1
            self._entries.pop(key, None)
            self._recorded.discard(key)
        return len(keys)

    # Watch callbacks and helpers

    async def _put_ranker(self, record: RankerRecord, lease: Lease) -> None:
        data = _with_key(record.to_json(), "lease", lease.id)
        await self._etcd.put(self._rankers_prefix + record.instance_id, data, lease)
        self.writes["put"] += 1

    def _on_ranker_event(self, event: WatchEvent) -> None:
        instance_id = event.key.removeprefix(self._rankers_prefix)
        if event.kind is EventKind.DELETE or event.value is None:
            self._drop_ranker(instance_id)
            if instance_id in self._owned:
                self._owned_record_seen(instance_id, None)
            return
        try:
            raw = json_object(event.value, RankerRecord.__name__, InvalidInput)
            record = RankerRecord.from_object(raw)
            lease_id = raw.get("lease")
            if isinstance(lease_id, bool) or not isinstance(lease_id, int) or lease_id <= 0:
                raise InvalidInput(f"lease must be a positive integer, got {lease_id!r}")
            if record.instance_id != instance_id:
                raise InvalidInput(f"record names instance {record.instance_id!r}")
        except InvalidInput as err:
            log.warning("ignoring malformed ranker record at %s: %s", event.key, err)
            self._drop_ranker(instance_id)
            return
        if instance_id not in self._rankers:
            self.members_changed_at = self._clock()
        self._rankers = {**self._rankers, instance_id: record}
        self._view = types.MappingProxyType(self._rankers)
        self._leases[instance_id] = lease_id
        if instance_id in self._owned:
            self._owned_record_seen(instance_id, lease_id)

    def _drop_ranker(self, instance_id: str) -> None:
        if instance_id not in self._rankers:
            return
        self._rankers = {k: v for k, v in self._rankers.items() if k != instance_id}
        self._view = types.MappingProxyType(self._rankers)
        self._leases.pop(instance_id, None)
        self.members_changed_at = self._clock()
        # etcd deletes the entries it holds with its lease; drop them (and those naming it) now.
        for key in [
            k
            for k, e in self._entries.items()
            if instance_id in (e.holder, e.placement.instance_id)
        ]:
            del self._entries[key]

    def _directory_key(self, key: _Key) -> str:
        version, user_id = key
        return f"{self._directory_prefix}{version}/{user_id}"

    def _on_directory_event(self, event: WatchEvent) -> None:
        version, slash, user_id = event.key.removeprefix(self._directory_prefix).partition("/")
        if not slash:
            log.debug("ignoring an unversioned placement (an older router's) at %s", event.key)
            return
        key = (version, user_id)
        if event.kind is EventKind.DELETE or event.value is None:
            self._apply(key, None, event.revision)
            return
        try:
            raw = json_object(event.value, PlacementRecord.__name__, InvalidInput)
            # Entries repeat a few names (rankers, versions) over many users: each is held
            # once, and the user id once, so a router's heap per entry is the entry's own.
            for name in ("instance_id", "model_version", "holder"):
                if isinstance(value := raw.get(name), str):
                    raw[name] = self._shared(value)
            placement = PlacementRecord.from_object(raw)
            holder = raw.get("holder")
            if not isinstance(holder, str) or not holder:
                raise InvalidInput(f"holder must be a non-empty string, got {holder!r}")
            if placement.user_id != user_id:
                raise InvalidInput(f"record names user {placement.user_id!r}")
            if placement.model_version != version:
                raise InvalidInput(f"record names model version {placement.model_version!r}")
        except InvalidInput as err:
            log.warning("ignoring malformed placement at %s: %s", event.key, err)
            self._apply(key, None, event.revision)
            return
        key = (placement.model_version, placement.user_id)
        self._apply(key, _Entry(placement, holder, event.revision), event.revision)

    def _shared(self, name: str) -> str:
        """The one string object kept for `name` (at most `_NAMES_KEPT` names are kept: a
        directory of malformed names costs no more than one without sharing)."""
        kept = self._names.get(name)
        if kept is not None:
            return kept
        if len(self._names) < _NAMES_KEPT:
            self._names[name] = name
        return name

    def _apply(self, key: _Key, entry: _Entry | None, revision: int) -> None:
        """Set (or, with None, drop) an entry as of `revision`, unless ours is newer."""
        current = self._entries.get(key)
        if current is not None and revision < current.revision:
            return
        if entry is None:
            self._entries.pop(key, None)
        else:
            self._entries[key] = entry


def entry_value(placement: PlacementRecord, holder_instance_id: str) -> bytes:
    """What the directory stores for `placement` held under `holder_instance_id`'s lease."""
    return _with_key(placement.to_json(), "holder", holder_instance_id)


def _with_key(record_json: bytes, key: str, value: object) -> bytes:
    """`record_json` (a JSON object) with one more key, in the records' compact sorted form."""
    return json.dumps(
        {**json.loads(record_json), key: value}, sort_keys=True, separators=(",", ":")
    ).encode()
