"""Which held prefixes a draining ranker hands off first: pure, for the core and the sender."""

from collections.abc import Iterable
from dataclasses import dataclass

from services.ranker.kv_store import CacheKey, Tier


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
