"""Two-tier prefix KV store (device "HBM" tier over a host "DRAM" tier), pure bookkeeping."""

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from relaygr.behaviours import UserId
from services.ranker.digest import ModelVersion, PrefixDigest
from services.ranker.keyed_heap import KeyedHeap
from services.ranker.outcomes import Origin


@dataclass(frozen=True, slots=True)
class CacheKey:
    """A prefix cache is valid only for this user, this model and this exact prefix content."""

    user_id: UserId
    model_version: ModelVersion
    digest: PrefixDigest


class Tier(StrEnum):
    HBM = "hbm"
    DRAM = "dram"


class Drop(StrEnum):
    """Why an entry left a tier."""

    DEMOTED = "demoted"  # HBM LRU eviction; a copy lives on in DRAM
    EVICTED = "evicted"  # LRU eviction with no copy kept
    EXPIRED = "expired"  # DRAM entry older than its time to live
    SUPERSEDED = "superseded"  # the user's prefix changed; the old one can never be used again
    TOO_LARGE = "too_large"  # would not fit the DRAM tier at all


@dataclass(slots=True)
class KVStats:
    """What the store has done since it started; the metrics read it by attribute."""

    stored: Counter[Tier] = field(default_factory=Counter)
    dropped: Counter[tuple[Tier, Drop]] = field(default_factory=Counter)
    hbm_rejected: int = 0  # prefixes the device tier could not hold beside pinned relays
    relays_consumed: int = 0  # pinned entries a Rank used
    relays_expired_unconsumed: int = 0  # pins whose relay window ended first
    relays_dropped_unconsumed: int = 0  # entries that left a tier while still pinned


class Cached(Protocol):
    """What the store needs of a cached prefix: its size. The ranker stores `PrefixKV`; the
    simulator stores sizes alone."""

    @property
    def nbytes(self) -> int: ...


KV = TypeVar("KV", bound=Cached)


@dataclass(slots=True)
class Entry(Generic[KV]):
    key: CacheKey
    kv: KV
    nbytes: int
    stored_at: float
    pinned_until: float | None = None  # relay window end while awaiting its Rank
    # When a relay last pinned it, until a Rank arrives for it (`rank_arrived`): kept past
    # the pin's end, so a Rank that comes late is still timed.
    relay_since: float | None = None
    # Opaque to the store: who produced or last relayed this prefix, as the engine's observer
    # sees it (a relay link's target). Kept when the entry is demoted to DRAM.
    origin: Origin | None = None
    # The store's: the number of this entry's latest use in its tier (a store or a `get`).
    last_use: int = 0

    @property
    def pinned(self) -> bool:
        return self.pinned_until is not None


@dataclass(slots=True)
class _Tier(Generic[KV]):
    """One tier's entries, with running totals and orders kept as entries change.

    Invariants: `used` and `pinned_bytes` are the sizes of all and of the pinned entries.
    Every unpinned entry is in exactly one of `lru` (in order of last use: an entry goes to its
    end when used, so the order holds) and `released` (entries whose pin ended behind newer
    uses, by last use); pinned entries are in neither, so eviction never meets one, and an
    entry whose pin is released takes back the place its last use gives it. `pins` holds
    exactly the pinned entries by the end of their pin; `stale_at` every entry by the end of
    the tier's time to live (empty without one).
    """

    budget: int
    ttl: float | None
    entries: dict[CacheKey, Entry[KV]] = field(default_factory=dict)
    lru: OrderedDict[CacheKey, None] = field(default_factory=OrderedDict)
    released: KeyedHeap[CacheKey] = field(default_factory=KeyedHeap)
    pins: KeyedHeap[CacheKey] = field(default_factory=KeyedHeap)
    stale_at: KeyedHeap[CacheKey] = field(default_factory=KeyedHeap)
    used: int = 0
    pinned_bytes: int = 0

    def add(self, entry: Entry[KV], use: int) -> None:
        """Add an entry at its first use (`use` is the newest use number)."""
        key = entry.key
        self.entries[key] = entry
        self.used += entry.nbytes
        entry.last_use = use
        if entry.pinned_until is not None:
            self.pinned_bytes += entry.nbytes
            self.pins.set(key, entry.pinned_until)
        else:
            self.lru[key] = None
        if self.ttl is not None:
            self.stale_at.set(key, entry.stored_at + self.ttl)

    def remove(self, key: CacheKey) -> Entry[KV]:
        """Take the entry out; it keeps its pin, so the caller can tell it was pinned."""
        entry = self.entries.pop(key)
        self.used -= entry.nbytes
        if entry.pinned:
            self.pinned_bytes -= entry.nbytes
            self.pins.discard(key)
        elif self.lru.pop(key, True):  # not in `lru`: released
            self.released.discard(key)
        self.stale_at.discard(key)
        return entry

    def touch(self, entry: Entry[KV], use: int) -> None:
        """Mark the entry most recently used (`use` is the newest use number)."""
        entry.last_use = use
        key = entry.key
        try:
            self.lru.move_to_end(key)
        except KeyError:  # pinned, or released
            if key in self.released:
                self.released.discard(key)
                self.lru[key] = None

    def pin(self, entry: Entry[KV], until: float) -> None:
        if entry.pinned_until is None:
            self.pinned_bytes += entry.nbytes
            if self.lru.pop(entry.key, True):
                self.released.discard(entry.key)
        if entry.pinned_until != until:
            entry.pinned_until = until
            self.pins.set(entry.key, until)

    def unpin(self, entry: Entry[KV]) -> None:
        if entry.pinned_until is None:
            return
        key = entry.key
        entry.pinned_until = None
        self.pinned_bytes -= entry.nbytes
        self.pins.discard(key)
        if not self.lru or self.entries[next(reversed(self.lru))].last_use < entry.last_use:
            self.lru[key] = None  # used since every entry in `lru`: its place is the end
        else:
            self.released.set(key, entry.last_use)

    def least_recent(self) -> Entry[KV]:
        """The unpinned entry used longest ago; the caller knows there is one."""
        oldest = next(iter(self.lru), None)
        first = None if oldest is None else self.entries[oldest]
        released = self.released.first()
        if released is not None:
            entry = self.entries[released]
            if first is None or entry.last_use < first.last_use:
                first = entry
        assert first is not None, "no unpinned entry to evict"
        return first


@dataclass(frozen=True, slots=True)
class TierUsage:
    budget_bytes: int
    used_bytes: int
    pinned_bytes: int
    entries: int


class KVStore(Generic[KV]):
    """Prefix caches in two tiers, each under a byte budget that no operation exceeds.

    HBM holds entries on the serving device. An entry stored by a PreInfer is pinned until a
    Rank consumes it or its relay window ends; pinned entries are never evicted. Unpinned HBM
    entries leave least-recently-used first and are demoted to DRAM (copied by `to_host`) unless
    DRAM already holds them. DRAM entries leave least-recently-used first or when older than
    `dram_ttl`. Storing a prefix for a user supersedes the user's other prefixes in both tiers,
    except relays still pinned for their Rank (two overlapping requests of one user each keep
    theirs). Time comes from `clock`, so expiry and LRU order are exact under test.

    Recency is a use number per tier (every store and `get` takes the next one); a pinned
    entry keeps its number, so once its pin is released it is as old as its last use. Totals
    and orders are kept as entries change, so every operation costs O(log n), amortised, in
    the number of entries (plus the few prefixes one user holds).
    """

    def __init__(
        self,
        hbm_budget: int,
        dram_budget: int,
        dram_ttl: float,
        clock: Callable[[], float],
        to_host: Callable[[KV], KV],
    ) -> None:
        self._tiers: dict[Tier, _Tier[KV]] = {
            Tier.HBM: _Tier(hbm_budget, None),
            Tier.DRAM: _Tier(dram_budget, dram_ttl),
        }
        # per user: the keys the store holds, oldest first
        self._by_user: dict[tuple[UserId, ModelVersion], list[CacheKey]] = {}
        self._clock = clock
        self._to_host = to_host
        self._uses = itertools.count()
        self.stats = KVStats()

    # -- queries ---------------------------------------------------------------------------

    def user_keys(self, user_id: UserId, model_version: ModelVersion) -> list[CacheKey]:
        """The keys of the prefixes the store holds for this user, newest first."""
        return self._by_user.get((user_id, model_version), [])[::-1]

    def tier_of(self, key: CacheKey) -> Tier | None:
        for tier in (Tier.HBM, Tier.DRAM):
            if key in self._tiers[tier].entries:
                return tier
        return None

    def peek(self, key: CacheKey, tier: Tier) -> Entry[KV] | None:
        return self._tiers[tier].entries.get(key)

    def peek_any(self, key: CacheKey) -> Entry[KV] | None:
        """The entry held under exactly `key`, the device tier's first, else its host copy;
        a peek: nothing moves in either tier's order, no pin changes."""
        entry = self.peek(key, Tier.HBM)
        return entry if entry is not None else self.peek(key, Tier.DRAM)

    def get(self, key: CacheKey, tier: Tier) -> KV | None:
        """The cached prefix, marking it most recently used in that tier."""
        t = self._tiers[tier]
        entry = t.entries.get(key)
        if entry is None:
            return None
        t.touch(entry, next(self._uses))
        return entry.kv

    def usage(self, tier: Tier) -> TierUsage:
        t = self._tiers[tier]
        return TierUsage(t.budget, t.used, t.pinned_bytes, len(t.entries))

    def entries(self, tier: Tier) -> list[Entry[KV]]:
        """The tier's entries, in no particular order (a snapshot: O(n), for a drain's plan)."""
        return list(self._tiers[tier].entries.values())

    def use_mark(self) -> int:
        """A use number below every later store's and `get`'s: entries used from now on have
        `last_use` >= it (`put_received` spares them)."""
        return next(self._uses)

    def fits_device(self, nbytes: int) -> bool:
        """Whether `nbytes` more could be pinned on the device, evicting every unpinned entry."""
        self.expire()
        hbm = self._tiers[Tier.HBM]
        return hbm.pinned_bytes + nbytes <= hbm.budget

    # -- changes ---------------------------------------------------------------------------

    def put_device(
        self, key: CacheKey, kv: KV, pin_for: float | None, origin: Origin | None = None
    ) -> bool:
        """Store `kv` in HBM, pinned for `pin_for` seconds (None: unpinned, LRU from the start).

        Makes room by demoting unpinned entries. Returns False, changing nothing, when the entry
        cannot fit beside the pinned ones. Re-storing a resident key refreshes its pin (and its
        `origin`, when one is given).
        """
        self.expire()
        hbm = self._tiers[Tier.HBM]
        now = self._clock()
        existing = hbm.entries.get(key)
        if existing is not None:
            if pin_for is not None:
                hbm.pin(existing, max(existing.pinned_until or 0.0, now + pin_for))
                existing.relay_since = now
            hbm.touch(existing, next(self._uses))
            if origin is not None:
                existing.origin = origin
            return True
        self._supersede(key)  # the user's old prefixes are dead whether or not this one fits
        nbytes = kv.nbytes
        if hbm.pinned_bytes + nbytes > hbm.budget:
            self.stats.hbm_rejected += 1
            return False
        while hbm.used + nbytes > hbm.budget:
            self._demote(hbm.least_recent())
        if pin_for is None:
            entry = Entry(key, kv, nbytes, now, origin=origin)
        else:
            entry = Entry(key, kv, nbytes, now, now + pin_for, relay_since=now, origin=origin)
        hbm.add(entry, next(self._uses))
        self._index(key)
        self.stats.stored[Tier.HBM] += 1
        return True

    def rank_arrived(self, key: CacheKey) -> float | None:
        """A Rank arrived for the HBM entry under `key`: seconds since a relay last pinned it
        (None: no relay awaits a Rank there). Once per relay: a second Rank is not timed."""
        entry = self._tiers[Tier.HBM].entries.get(key)
        if entry is None or entry.relay_since is None:
            return None
        since, entry.relay_since = entry.relay_since, None
        return self._clock() - since

    def consume(self, key: CacheKey) -> None:
        """A Rank used the HBM entry: its relay is done; it becomes evictable."""
        hbm = self._tiers[Tier.HBM]
        entry = hbm.entries.get(key)
        if entry is None:
            return
        if entry.pinned:
            self.stats.relays_consumed += 1
        hbm.unpin(entry)

    def put_host(self, key: CacheKey, kv: KV, origin: Origin | None = None) -> bool:
        """Store a host copy in DRAM (evicting LRU DRAM entries); False if too large.

        A demotion, not a new prefix: it supersedes nothing.
        """
        self.expire()
        dram = self._tiers[Tier.DRAM]
        held = dram.entries.get(key)
        if held is not None:
            dram.touch(held, next(self._uses))
            return True
        if kv.nbytes > dram.budget:
            self.stats.dropped[Tier.DRAM, Drop.TOO_LARGE] += 1
            return False
        while dram.used + kv.nbytes > dram.budget:
            self._drop(Tier.DRAM, dram.least_recent().key, Drop.EVICTED)
        dram.add(Entry(key, kv, kv.nbytes, self._clock(), origin=origin), next(self._uses))
        self._index(key, newest=False)
        self.stats.stored[Tier.DRAM] += 1
        return True

    def put_received(
        self, key: CacheKey, kv: KV, origin: Origin | None, idle_before: int
    ) -> Tier | None:
        """Store a prefix a peer handed over, unpinned; the tier it went to, or None (no room).

        Into HBM when it fits there by demoting only unpinned entries last used before use
        number `idle_before` (a `use_mark` taken when the hand-off began), else into DRAM (a
        host copy) evicting only such entries; what was used since (this ranker's own traffic,
        or entries received earlier in the hand-off, which came first because they were worth
        more) is never displaced. A key already held is left as it is (its tier is returned).
        Supersedes nothing: the caller decides about the user's other prefixes.
        """
        self.expire()
        held = self.tier_of(key)
        if held is not None:
            return held
        nbytes = kv.nbytes
        hbm, dram = self._tiers[Tier.HBM], self._tiers[Tier.DRAM]
        if hbm.used + nbytes - hbm.budget <= _idle_bytes(hbm, idle_before):
            while hbm.used + nbytes > hbm.budget:
                self._demote(hbm.least_recent())
            hbm.add(Entry(key, kv, nbytes, self._clock(), origin=origin), next(self._uses))
            self._index(key)
            self.stats.stored[Tier.HBM] += 1
            return Tier.HBM
        if dram.used + nbytes - dram.budget <= _idle_bytes(dram, idle_before):
            while dram.used + nbytes > dram.budget:
                self._drop(Tier.DRAM, dram.least_recent().key, Drop.EVICTED)
            host = self._to_host(kv)
            dram.add(Entry(key, host, nbytes, self._clock(), origin=origin), next(self._uses))
            self._index(key)
            self.stats.stored[Tier.DRAM] += 1
            return Tier.DRAM
        return None

    def expire(self) -> None:
        """Release pins whose relay window ended; drop DRAM entries past their time to live."""
        now = self._clock()
        hbm = self._tiers[Tier.HBM]
        for key in hbm.pins.pop_due(now):
            hbm.unpin(hbm.entries[key])
            self.stats.relays_expired_unconsumed += 1
        for key in self._tiers[Tier.DRAM].stale_at.pop_due(now):
            self._drop(Tier.DRAM, key, Drop.EXPIRED)

    # -- internals -------------------------------------------------------------------------

    def _index(self, key: CacheKey, newest: bool = True) -> None:
        """Record `key` under its user: as the newest prefix, or where it is (a demotion)."""
        keys = self._by_user.setdefault((key.user_id, key.model_version), [])
        if key in keys:
            if not newest:
                return
            keys.remove(key)
        keys.insert(len(keys) if newest else 0, key)

    def _supersede(self, key: CacheKey) -> None:
        """Drop the user's other prefixes, except relays still pinned for their Rank."""
        for old in self.user_keys(key.user_id, key.model_version):
            held = self._tiers[Tier.HBM].entries.get(old)
            if old == key or (held is not None and held.pinned):
                continue
            for tier in (Tier.HBM, Tier.DRAM):
                if old in self._tiers[tier].entries:
                    self._drop(tier, old, Drop.SUPERSEDED)

    def _demote(self, entry: Entry) -> None:
        """Evict an unpinned HBM entry, keeping a host copy in DRAM when one fits."""
        key = entry.key
        dram = self._tiers[Tier.DRAM]
        if key not in dram.entries and entry.kv.nbytes <= dram.budget:  # else no copy is made
            self.put_host(key, self._to_host(entry.kv), entry.origin)
        kept = key in self._tiers[Tier.DRAM].entries
        self._drop(Tier.HBM, key, Drop.DEMOTED if kept else Drop.EVICTED)

    def _drop(self, tier: Tier, key: CacheKey, reason: Drop) -> None:
        entry = self._tiers[tier].remove(key)
        self.stats.dropped[tier, reason] += 1
        if entry.pinned:
            self.stats.relays_dropped_unconsumed += 1
        if self.tier_of(key) is None:
            user = (key.user_id, key.model_version)
            keys = self._by_user[user]
            keys.remove(key)
            if not keys:
                del self._by_user[user]


def _idle_bytes(tier: _Tier[KV], idle_before: int) -> int:
    """Bytes of the tier's unpinned entries last used before use number `idle_before`: what a
    received prefix may displace (LRU order is last-use order, so eviction reaches these
    first). O(n): a hand-off is rare, not the serving path."""
    return sum(e.nbytes for e in tier.entries.values() if not e.pinned and e.last_use < idle_before)
