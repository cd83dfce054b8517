"""Hand-off decisions, pure: which held prefixes a draining ranker sends first, and whether a
receiving ranker stores one. The core, the gRPC sender and intake, and the simulator use them."""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol

from services.ranker.kv_store import KV, CacheKey, Entry, KVStore, Tier
from services.ranker.outcomes import Origin


@dataclass(frozen=True, slots=True)
class Candidate:
    """A held prefix as the plan sees it (a snapshot of its store entry)."""

    key: CacheKey
    tier: Tier
    nbytes: int
    pinned_until: float | None
    last_use: int  # the store's use number in its tier


def value_rank(c: Candidate) -> tuple[int, float]:
    """Sort key, most valuable first: HBM entries pinned for a relay (their Rank is due) by
    earliest pin end; then unpinned HBM entries, most recently used first; then DRAM entries,
    most recently used first. Use numbers are compared only within a tier."""
    if c.tier is Tier.HBM and c.pinned_until is not None:
        return (0, c.pinned_until)
    return (1 if c.tier is Tier.HBM else 2, -c.last_use)


def value_order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The candidates most valuable first (`value_rank`), one per key (its HBM copy wins)."""
    ordered = sorted(candidates, key=value_rank)
    seen: set[CacheKey] = set()
    unique = []
    for c in ordered:
        if c.key not in seen:
            seen.add(c.key)
            unique.append(c)
    return unique


class Declined(StrEnum):
    """Why a handed-off entry is not stored (the receiving side's decision)."""

    COMPUTING = "computing"  # this ranker is computing that prefix itself
    HELD = "held"  # it holds another prefix of the user: its own is kept (it may be newer)
    NO_ROOM = "no_room"  # the tiers cannot take it without displacing entries in use


def admit_received(
    store: KVStore[KV],
    key: CacheKey,
    kv: KV,
    origin: Origin | None,
    idle_before: int,
    computing: Callable[[CacheKey], bool],
) -> Tier | Declined:
    """Store a handed-off entry unpinned (`KVStore.put_received`: displacing only entries idle
    since `idle_before`) and say in which tier; an entry whose key is held already counts as
    admitted where it is, and is not stored twice."""
    tier = store.tier_of(key)
    if tier is not None:
        return tier
    if computing(key):
        return Declined.COMPUTING
    if store.user_keys(key.user_id, key.model_version):
        return Declined.HELD
    tier = store.put_received(key, kv, origin, idle_before)
    return Declined.NO_ROOM if tier is None else tier


def held_candidates(store: KVStore[KV]) -> list[Candidate]:
    """Every prefix `store` holds, in both tiers, most valuable first (`value_order`); pins past
    their window and stale host copies are expired first."""
    store.expire()
    return value_order(
        Candidate(e.key, tier, e.nbytes, e.pinned_until, e.last_use)
        for tier in Tier
        for e in store.entries(tier)
    )


class PrefixHolder(Protocol[KV]):
    """What a hand-off's two ends need of a ranker's prefixes: `RankerCore`, or `StoreHolder`."""

    def handoff_order(self) -> list[Candidate]: ...

    def held_for_peer(self, key: CacheKey) -> Entry[KV] | None: ...

    def use_mark(self) -> int: ...

    def receive(
        self, key: CacheKey, kv: KV, origin: Origin | None, idle_before: int
    ) -> Tier | Declined: ...


class StoreHolder(Generic[KV]):
    """A `PrefixHolder` over a bare store (nothing computing unless `computing` says so)."""

    def __init__(
        self, store: KVStore[KV], computing: Callable[[CacheKey], bool] = lambda _: False
    ) -> None:
        self._store = store
        self._computing = computing

    def handoff_order(self) -> list[Candidate]:
        return held_candidates(self._store)

    def held_for_peer(self, key: CacheKey) -> Entry[KV] | None:
        return self._store.peek_any(key)

    def use_mark(self) -> int:
        return self._store.use_mark()

    def receive(
        self, key: CacheKey, kv: KV, origin: Origin | None, idle_before: int
    ) -> Tier | Declined:
        return admit_received(self._store, key, kv, origin, idle_before, self._computing)
