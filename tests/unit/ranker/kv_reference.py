"""A deliberately naive model of the KV store: plain lists, scanned on every call.

Written apart from services/ranker/kv_store.py, from its documented behaviour, so that the
store's running totals, heaps and LRU bookkeeping can be checked against something that has
none of them.
"""

from collections.abc import Callable
from dataclasses import dataclass

from services.ranker.kv_store import CacheKey, Drop, KVStats, Tier


@dataclass
class RefEntry:
    key: CacheKey
    nbytes: int
    stored_at: float
    pinned_until: float | None = None


class ReferenceStore:
    """Each tier a list, least recently used first; sizes only, no tensors."""

    def __init__(
        self, hbm_budget: int, dram_budget: int, ttl: float, clock: Callable[[], float]
    ) -> None:
        self.budget = {Tier.HBM: hbm_budget, Tier.DRAM: dram_budget}
        self.tiers: dict[Tier, list[RefEntry]] = {Tier.HBM: [], Tier.DRAM: []}
        self.users: dict[str, list[CacheKey]] = {}  # oldest first
        self.ttl = ttl
        self.clock = clock
        self.stats = KVStats()

    def find(self, tier: Tier, key: CacheKey) -> RefEntry | None:
        return next((e for e in self.tiers[tier] if e.key == key), None)

    def used(self, tier: Tier) -> int:
        return sum(e.nbytes for e in self.tiers[tier])

    def pinned(self, tier: Tier) -> int:
        return sum(e.nbytes for e in self.tiers[tier] if e.pinned_until is not None)

    def user_keys(self, user: str) -> list[CacheKey]:
        return list(reversed(self.users.get(user, [])))

    def touch(self, tier: Tier, entry: RefEntry) -> None:
        self.tiers[tier].remove(entry)
        self.tiers[tier].append(entry)

    def expire(self) -> None:
        now = self.clock()
        for e in self.tiers[Tier.HBM]:
            if e.pinned_until is not None and e.pinned_until <= now:
                e.pinned_until = None
                self.stats.relays_expired_unconsumed += 1
        for e in list(self.tiers[Tier.DRAM]):
            if e.stored_at + self.ttl <= now:
                self.drop(Tier.DRAM, e, Drop.EXPIRED)

    def drop(self, tier: Tier, entry: RefEntry, reason: Drop) -> None:
        self.tiers[tier].remove(entry)
        self.stats.dropped[tier, reason] += 1
        if entry.pinned_until is not None:
            self.stats.relays_dropped_unconsumed += 1
        key = entry.key
        if self.find(Tier.HBM, key) is None and self.find(Tier.DRAM, key) is None:
            self.users[key.user_id].remove(key)
            if not self.users[key.user_id]:
                del self.users[key.user_id]

    def get(self, key: CacheKey, tier: Tier) -> bool:
        entry = self.find(tier, key)
        if entry is not None:
            self.touch(tier, entry)
        return entry is not None

    def fits_device(self, nbytes: int) -> bool:
        self.expire()
        return self.pinned(Tier.HBM) + nbytes <= self.budget[Tier.HBM]

    def consume(self, key: CacheKey) -> None:
        entry = self.find(Tier.HBM, key)
        if entry is not None:
            if entry.pinned_until is not None:
                self.stats.relays_consumed += 1
            entry.pinned_until = None

    def put_device(self, key: CacheKey, nbytes: int, pin_for: float | None) -> bool:
        self.expire()
        now = self.clock()
        entry = self.find(Tier.HBM, key)
        if entry is not None:
            self.touch(Tier.HBM, entry)
            if pin_for is not None:
                entry.pinned_until = max(entry.pinned_until or 0.0, now + pin_for)
            return True
        for old in self.user_keys(key.user_id):
            held = self.find(Tier.HBM, old)
            if old == key or (held is not None and held.pinned_until is not None):
                continue
            for tier in (Tier.HBM, Tier.DRAM):
                found = self.find(tier, old)
                if found is not None:
                    self.drop(tier, found, Drop.SUPERSEDED)
        if self.pinned(Tier.HBM) + nbytes > self.budget[Tier.HBM]:
            self.stats.hbm_rejected += 1
            return False
        while self.used(Tier.HBM) + nbytes > self.budget[Tier.HBM]:
            victim = next(e for e in self.tiers[Tier.HBM] if e.pinned_until is None)
            if self.find(Tier.DRAM, victim.key) is None and victim.nbytes <= self.budget[Tier.DRAM]:
                self.put_host(victim.key, victim.nbytes)
            kept = self.find(Tier.DRAM, victim.key) is not None
            self.drop(Tier.HBM, victim, Drop.DEMOTED if kept else Drop.EVICTED)
        until = None if pin_for is None else now + pin_for
        self.tiers[Tier.HBM].append(RefEntry(key, nbytes, now, until))
        keys = self.users.setdefault(key.user_id, [])
        if key in keys:
            keys.remove(key)
        keys.append(key)
        self.stats.stored[Tier.HBM] += 1
        return True

    def put_host(self, key: CacheKey, nbytes: int) -> bool:
        self.expire()
        entry = self.find(Tier.DRAM, key)
        if entry is not None:
            self.touch(Tier.DRAM, entry)
            return True
        if nbytes > self.budget[Tier.DRAM]:
            self.stats.dropped[Tier.DRAM, Drop.TOO_LARGE] += 1
            return False
        while self.used(Tier.DRAM) + nbytes > self.budget[Tier.DRAM]:
            self.drop(Tier.DRAM, self.tiers[Tier.DRAM][0], Drop.EVICTED)
        self.tiers[Tier.DRAM].append(RefEntry(key, nbytes, self.clock()))
        keys = self.users.setdefault(key.user_id, [])
        if key not in keys:
            keys.insert(0, key)
        self.stats.stored[Tier.DRAM] += 1
        return True
