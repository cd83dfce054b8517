"""Two-tier prefix KV store (device "HBM" tier over a host "DRAM" tier), pure bookkeeping."""

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from relaygr.behaviours import UserId
from services.ranker.digest import PrefixDigest
from services.ranker.observer import Origin
from services.ranker.prefix_kv import ModelVersion, PrefixKV


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
class Entry:
    key: CacheKey
    kv: PrefixKV
    nbytes: int
    stored_at: float
    pinned_until: float | None = None  # relay window end while awaiting its Rank
    # Opaque to the store: who produced or last relayed this prefix, as the engine's observer
    # sees it (a relay link's target). Kept when the entry is demoted to DRAM.
    origin: Origin | None = None

    @property
    def pinned(self) -> bool:
        return self.pinned_until is not None


@dataclass(slots=True)
class _Tier:
    budget: int
    entries: OrderedDict[CacheKey, Entry] = field(default_factory=OrderedDict)  # LRU first
    used: int = 0

    def add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        self.used += entry.nbytes

    def remove(self, key: CacheKey) -> Entry:
        entry = self.entries.pop(key)
        self.used -= entry.nbytes
        return entry

    @property
    def pinned_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.pinned)


@dataclass(frozen=True, slots=True)
class TierUsage:
    budget_bytes: int
    used_bytes: int
    pinned_bytes: int
    entries: int


class KVStore:
    """Prefix caches in two tiers, each under a byte budget that no operation exceeds.

    HBM holds entries on the serving device. An entry stored by a PreInfer is pinned until a
    Rank consumes it or its relay window ends; pinned entries are never evicted. Unpinned HBM
    entries leave least-recently-used first and are demoted to DRAM (copied by `to_host`) unless
    DRAM already holds them. DRAM entries leave least-recently-used first or when older than
    `dram_ttl`. Storing a prefix for a user supersedes the user's other prefixes in both tiers,
    except relays still pinned for their Rank (two overlapping requests of one user each keep
    theirs). Time comes from `clock`, so expiry and LRU order are exact under test.
    """

    def __init__(
        self,
        hbm_budget: int,
        dram_budget: int,
        dram_ttl: float,
        clock: Callable[[], float],
        to_host: Callable[[PrefixKV], PrefixKV],
    ) -> None:
        self._tiers = {Tier.HBM: _Tier(hbm_budget), Tier.DRAM: _Tier(dram_budget)}
        # per user: the keys the store holds, oldest first
        self._by_user: dict[tuple[UserId, ModelVersion], list[CacheKey]] = {}
        self._dram_ttl = dram_ttl
        self._clock = clock
        self._to_host = to_host
        self.counters: Counter[str] = Counter()

    # -- queries ---------------------------------------------------------------------------

    def user_keys(self, user_id: UserId, model_version: ModelVersion) -> list[CacheKey]:
        """The keys of the prefixes the store holds for this user, newest first."""
        return self._by_user.get((user_id, model_version), [])[::-1]

    def tier_of(self, key: CacheKey) -> Tier | None:
        for tier in (Tier.HBM, Tier.DRAM):
            if key in self._tiers[tier].entries:
                return tier
        return None

    def peek(self, key: CacheKey, tier: Tier) -> Entry | None:
        return self._tiers[tier].entries.get(key)

    def get(self, key: CacheKey, tier: Tier) -> PrefixKV | None:
        """The cached prefix, marking it most recently used in that tier."""
        entries = self._tiers[tier].entries
        entry = entries.get(key)
        if entry is None:
            return None
        entries.move_to_end(key)
        return entry.kv

    def usage(self, tier: Tier) -> TierUsage:
        t = self._tiers[tier]
        return TierUsage(t.budget, t.used, t.pinned_bytes, len(t.entries))

    def fits_device(self, nbytes: int) -> bool:
        """Whether `nbytes` more could be pinned on the device, evicting every unpinned entry."""
        self.expire()
        hbm = self._tiers[Tier.HBM]
        return hbm.pinned_bytes + nbytes <= hbm.budget

    # -- changes ---------------------------------------------------------------------------

    def put_device(
        self, key: CacheKey, kv: PrefixKV, pin_for: float | None, origin: Origin | None = None
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
            hbm.entries.move_to_end(key)
            if pin_for is not None:
                existing.pinned_until = max(existing.pinned_until or 0.0, now + pin_for)
            if origin is not None:
                existing.origin = origin
            return True
        self._supersede(key)  # the user's old prefixes are dead whether or not this one fits
        nbytes = kv.nbytes
        if hbm.pinned_bytes + nbytes > hbm.budget:
            self.counters["hbm_rejected"] += 1
            return False
        while hbm.used + nbytes > hbm.budget:
            self._demote(next(e for e in hbm.entries.values() if not e.pinned))
        pinned_until = None if pin_for is None else now + pin_for
        hbm.add(Entry(key, kv, nbytes, now, pinned_until, origin))
        self._index(key)
        self.counters["hbm_stored"] += 1
        return True

    def consume(self, key: CacheKey) -> None:
        """A Rank used the HBM entry: its relay is done; it becomes evictable."""
        entry = self._tiers[Tier.HBM].entries.get(key)
        if entry is None:
            return
        if entry.pinned:
            self.counters["relays_consumed"] += 1
        entry.pinned_until = None

    def put_host(self, key: CacheKey, kv: PrefixKV, origin: Origin | None = None) -> bool:
        """Store a host copy in DRAM (evicting LRU DRAM entries); False if too large.

        A demotion, not a new prefix: it supersedes nothing.
        """
        self.expire()
        dram = self._tiers[Tier.DRAM]
        if key in dram.entries:
            dram.entries.move_to_end(key)
            return True
        if kv.nbytes > dram.budget:
            self.counters[f"dram_dropped_{Drop.TOO_LARGE}"] += 1
            return False
        while dram.used + kv.nbytes > dram.budget:
            self._drop(Tier.DRAM, next(iter(dram.entries)), Drop.EVICTED)
        dram.add(Entry(key, kv, kv.nbytes, self._clock(), origin=origin))
        self._index(key, newest=False)
        self.counters["dram_stored"] += 1
        return True

    def expire(self) -> None:
        """Release pins whose relay window ended; drop DRAM entries past their time to live."""
        now = self._clock()
        for entry in self._tiers[Tier.HBM].entries.values():
            if entry.pinned_until is not None and entry.pinned_until <= now:
                entry.pinned_until = None
                self.counters["relays_expired_unconsumed"] += 1
        dram = self._tiers[Tier.DRAM]
        stale = [k for k, e in dram.entries.items() if e.stored_at + self._dram_ttl <= now]
        for key in stale:
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
        self.counters[f"{tier}_dropped_{reason}"] += 1
        if entry.pinned:
            self.counters["relays_dropped_unconsumed"] += 1
        if self.tier_of(key) is None:
            user = (key.user_id, key.model_version)
            keys = self._by_user[user]
            keys.remove(key)
            if not keys:
                del self._by_user[user]
