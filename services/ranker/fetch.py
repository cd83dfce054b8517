"""Peer fetch: a prefix this ranker misses, fetched from a peer that may hold it (after a move).

Pure of transport: `PeerSource` is the port (its gRPC implementation is `fetch_client.py`);
`PeerFetch` decides whom to ask, for how long, and keeps the transfer cost and the counts.
"""

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from relaygr.cost import TransferCost
from services.ranker.kv_store import CacheKey
from services.ranker.outcomes import FetchResult
from services.ranker.prefix_kv import PrefixKV
from services.ranker.transfer_cost import TransferLearner, TransferSample


@dataclass(frozen=True, slots=True)
class Peer:
    instance_id: str
    address: str
    previous_owner: bool = False  # asked as the user's owner before this ranker


@dataclass(frozen=True, slots=True)
class Fetched:
    """A received entry that passed `transfer.Receiver`'s checks, with its producer's W3C
    traceparent (empty: not known)."""

    kv: PrefixKV
    origin_traceparent: str = ""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One fetch from one peer: what came of it, its payload bytes (a hit's), how long it took
    (`seconds`, from `start_ns` on the wall clock) and the producer's traceparent on a hit."""

    peer: Peer
    result: FetchResult
    nbytes: int
    seconds: float
    start_ns: int
    origin_traceparent: str = ""


class PeerSource(Protocol):
    """Where fetches go: the peers that may hold a key and one fetch from one of them."""

    def peers(self, key: CacheKey) -> Sequence[Peer]:
        """The peers that may hold `key`, most likely first; this ranker never. No I/O."""
        ...

    async def fetch(self, key: CacheKey, peer: Peer, timeout_s: float) -> Fetched | FetchResult:
        """The entry held under exactly `key`, checked on receipt, or why there is none.
        Returns within `timeout_s`; never raises for what a peer does."""
        ...


@dataclass(frozen=True, slots=True)
class FetchSettings:
    """A fetch from one peer may take twice its predicted time plus `floor_s`, at most
    `cap_s` and never past the request's deadline; at most `max_peers` are asked in turn."""

    cap_s: float
    floor_s: float = 0.02
    max_peers: int = 2

    def timeout_s(self, predicted_ms: float, remaining_s: float | None) -> float:
        timeout = min(self.cap_s, self.floor_s + 2 * predicted_ms / 1e3)
        return timeout if remaining_s is None else max(min(timeout, remaining_s), 0.0)


@dataclass(slots=True)
class FetchStats:
    """What fetching has done since start; the metrics read it by attribute."""

    attempts: Counter[FetchResult] = field(default_factory=Counter)
    bytes_fetched: int = 0


# Where each attempt's time goes (a latency histogram): its result and seconds.
FetchSink = Callable[[FetchResult, float], None]


class PeerFetch:
    """Fetches for one engine: asks its `source`'s peers in turn until one holds the key.

    The transfer cost in use (`transfer`) is the configured prior, refitted from the hits'
    timings when `learn`; the engine reads it for every decision, so a refit applies at once.
    A fetch never raises for a peer's failure: it returns None and the engine computes.
    """

    def __init__(
        self,
        source: PeerSource,
        settings: FetchSettings,
        prior: TransferCost,
        learn: bool = True,
        timings: FetchSink | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.source = source
        self.settings = settings
        self._learner = TransferLearner(prior) if learn else None
        self._prior = prior
        self._timings = timings
        self._clock = clock
        self.stats = FetchStats()

    @property
    def transfer(self) -> TransferCost:
        return self._learner.model if self._learner is not None else self._prior

    def peers(self, key: CacheKey) -> list[Peer]:
        return list(self.source.peers(key))[: self.settings.max_peers]

    def transfer_ms(self, nbytes: int) -> float:
        """The predicted time to fetch `nbytes` (the transfer cost in use)."""
        return self.transfer.ms(nbytes)

    async def fetch(
        self,
        key: CacheKey,
        peers: Sequence[Peer],
        nbytes: int,
        num_user_tokens: int,
        remaining_s: Callable[[], float | None],
    ) -> tuple[Fetched | None, list[Attempt]]:
        """The entry of `key` (which must be `nbytes` with `num_user_tokens` user tokens) from
        the first of `peers` that has it, and every attempt made; `remaining_s()` is the time
        left to the request's deadline (None: none)."""
        attempts: list[Attempt] = []
        for peer in peers:
            left = remaining_s()
            if left is not None and left <= 0:
                break
            timeout = self.settings.timeout_s(self.transfer.ms(nbytes), left)
            start, start_ns = self._clock(), time.time_ns()
            got = await self._one(key, peer, timeout)
            if isinstance(got, Fetched) and not _matches(got.kv, key, nbytes, num_user_tokens):
                got = FetchResult.REFUSED
            seconds = self._clock() - start
            result = FetchResult.HIT if isinstance(got, Fetched) else got
            self.stats.attempts[result] += 1
            if self._timings is not None:
                self._timings(result, seconds)
            if isinstance(got, Fetched):
                self.stats.bytes_fetched += nbytes
                if self._learner is not None:
                    self._learner.observe(TransferSample(nbytes, seconds * 1e3))
                attempts.append(
                    Attempt(peer, result, nbytes, seconds, start_ns, got.origin_traceparent)
                )
                return got, attempts
            attempts.append(Attempt(peer, result, 0, seconds, start_ns))
        return None, attempts

    async def _one(self, key: CacheKey, peer: Peer, timeout_s: float) -> Fetched | FetchResult:
        """One peer's answer within `timeout_s`, whatever the source does."""
        try:
            # The source keeps its own deadline; this one also bounds a source that would not.
            async with asyncio.timeout(timeout_s + self.settings.floor_s):
                return await self.source.fetch(key, peer, timeout_s)
        except TimeoutError:
            return FetchResult.TIMEOUT
        except Exception:  # a peer's failure never fails the request
            return FetchResult.ERROR


def _matches(kv: PrefixKV, key: CacheKey, nbytes: int, num_user_tokens: int) -> bool:
    """A received entry is the one asked for: its key, its size and its layout."""
    return (
        kv.digest == key.digest
        and kv.model_version == key.model_version
        and kv.nbytes == nbytes
        and kv.num_user_tokens == num_user_tokens
    )
