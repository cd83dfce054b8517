"""How the ranker core makes a missing prefix device-resident: the cheapest plan (reload, extend,
prefill, fetch) over its store, as job data."""

from collections.abc import Callable
from typing import Any, Generic, NamedTuple, Protocol

from relaygr.cost import CostModel
from services.ranker.core_types import KV, Extend, Prefill, PrefixRef, Reload, Spec
from services.ranker.kv_store import CacheKey, KVStore, Tier
from services.ranker.outcomes import Origin
from services.ranker.plan import Held, Source, cheapest


class PeerPlanner(Protocol):
    """Whom a missing prefix may be fetched from, and the predicted transfer time (no I/O)."""

    def peers(self, key: CacheKey) -> list[Any]: ...

    def transfer_ms(self, nbytes: int) -> float: ...


class Plan(NamedTuple):
    source: Source
    spec: Spec | None  # None: a fetch (no compute job)
    computed_tokens: int  # prefix tokens it computes (0 for a reload or a fetch)
    step_ms: tuple[float, ...]  # each step's predicted time


class Planner(Generic[KV]):
    """Plans over `store` with the cost model in use (`cost_model`, replaced on a refit)."""

    def __init__(
        self,
        store: KVStore[KV],
        cost_model: CostModel,
        kv_bytes_per_token: int,
        held_of: Callable[[KV], Held],
        peers: PeerPlanner | None,
    ) -> None:
        self.store = store
        self.cost_model = cost_model
        self._bytes_per_token = kv_bytes_per_token
        self._held_of = held_of
        self._peers = peers

    def nbytes(self, prefix: PrefixRef) -> int:
        """What `prefix` holds once made."""
        return (prefix.user_features + prefix.behaviours) * self._bytes_per_token

    def reload_origin(self, key: CacheKey, origin: Origin | None) -> Origin | None:
        """A reload's content is its host copy's: it keeps the copy's producer when known."""
        entry = self.store.peek(key, Tier.DRAM)
        return entry.origin if entry is not None and entry.origin is not None else origin

    def fetch_peers(self, key: CacheKey) -> list[Any]:
        """None without peer fetch, or when a host copy of `key` is here (reloading it is this
        ranker's own business)."""
        if self._peers is None or self.store.peek(key, Tier.DRAM) is not None:
            return []
        return self._peers.peers(key)

    def plan(
        self, key: CacheKey, prefix: PrefixRef, chunk: int | None, peers: list[Any] | None = None
    ) -> Plan:
        """The cheapest way to make `key` device-resident (`plan.cheapest`): its source, job
        (None: a fetch), the prefix tokens it computes and each step's predicted time."""
        held = self.store.peek(key, Tier.DRAM)
        base = self.extendable(key, prefix)
        fetch_ms = None
        if peers and self._peers is not None:
            nbytes = self.nbytes(prefix)
            fetch_ms = self._peers.transfer_ms(nbytes)
        costed = cheapest(
            self.cost_model,
            prefix.user_features,
            prefix.behaviours,
            None if held is None else self._held_of(held.kv),
            None if base is None else self._held_of(base),
            chunk,
            fetch_ms,
        )
        size = chunk if chunk is not None else max(prefix.user_features + prefix.behaviours, 1)
        spec: Spec | None = None
        if costed.source is Source.RELOAD:
            assert held is not None
            spec = Reload(held.kv)
        elif costed.source is Source.EXTEND:
            assert base is not None
            spec = Extend(prefix, base, self._held_of(base).num_behaviours, size)
        elif costed.source is Source.PREFILL:
            spec = Prefill(prefix, size)
        return Plan(costed.source, spec, costed.computed_tokens, costed.step_ms)

    def extendable(self, key: CacheKey, prefix: PrefixRef) -> KV | None:
        """The user's newest cached prefix that is a strict prefix of `prefix` (its digest is
        that of `prefix`'s head of the same length), if any."""
        for old in self.store.user_keys(key.user_id, key.model_version):
            tier = self.store.tier_of(old)
            entry = self.store.peek(old, tier) if tier is not None else None
            if entry is None:
                continue
            n = self._held_of(entry.kv).num_behaviours
            if n < prefix.behaviours and prefix.head_digest(n) == old.digest:
                return entry.kv
        return None
