"""Hand-off on drain, sending side: which prefixes go where, in what order, how fast, how long.

Pure of transport and tracing: the streams to peers come through an injected `HandoffPort`
(services/ranker/handoff_grpc.py is the gRPC one), time through an injected clock and sleep.
"""

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from relaygr.cluster import RankerRecord
from services.ranker.config import RankerConfig
from services.ranker.handoff_order import Candidate, PrefixHolder
from services.ranker.kv_store import CacheKey, Tier
from services.ranker.observer import Origin
from services.ranker.peers import successor
from services.ranker.prefix_kv import PrefixKV
from services.ranker.transfer import CHUNK_BYTES, EntryHeader, Refusal, chunks, encode

_log = logging.getLogger("services.ranker.handoff")

# What a hand-off stream carries: an entry's header, then its payload in pieces.
Piece = EntryHeader | memoryview


@dataclass(slots=True)
class HandoffStats:
    """Hand-offs since start, sent and received; the metrics read it by attribute."""

    sent_entries: int = 0
    sent_bytes: int = 0
    unsent_entries: int = 0  # planned but not sent: past the time budget, or its target failed
    failed_streams: int = 0  # streams to a target that ended in an error (its rest unsent)
    send_seconds: float = 0.0  # wall time of the drains' hand-offs
    received_streams: int = 0
    refused_streams: int = 0  # whole streams refused: draining, too many at once
    admitted: Counter[Tier] = field(default_factory=Counter)
    admitted_bytes: Counter[Tier] = field(default_factory=Counter)
    refused: Counter[Refusal] = field(default_factory=Counter)
    refused_bytes: Counter[Refusal] = field(default_factory=Counter)
    receive_seconds: float = 0.0  # summed over received streams
    # streams taken, by sending ranker (its certificate's instance under mutual TLS)
    received_from: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class Target:
    instance_id: str
    address: str


def plan(
    ordered: Sequence[Candidate],
    view: Mapping[str, RankerRecord],
    self_id: str,
    model_version: str,
    max_entries: int,
) -> dict[Target, list[Candidate]]:
    """Each next owner and the prefixes it gets, in value order: the first `max_entries` of
    `ordered` whose user has a successor (`peers.successor`) serving the same model version."""
    routes: dict[Target, list[Candidate]] = {}
    for c in ordered[:max_entries]:
        owner = successor(c.key.user_id, view, self_id, model_version)
        if owner is None:
            continue
        routes.setdefault(Target(owner, view[owner].address), []).append(c)
    return routes


class Bandwidth:
    """A byte-rate bound shared by every stream of a hand-off (virtual scheduling: each
    reservation starts when the previous ones are through). Exact under an injected clock."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float]) -> None:
        self._rate = bytes_per_s
        self._clock = clock
        self._free_at = clock()

    def reserve(self, nbytes: int) -> float:
        """Book `nbytes`; how many seconds to wait before sending them."""
        now = self._clock()
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self._rate
        return start - now

    def done_at(self, nbytes: int) -> float:
        """When `nbytes` booked now would be through (books nothing)."""
        return max(self._clock(), self._free_at) + nbytes / self._rate


@dataclass(frozen=True, slots=True)
class Receipt:
    """A target's reply: what it admitted and refused."""

    admitted: int
    refused: int
    admitted_bytes: int
    refusals: tuple[str, ...] = ()


class HandoffFailed(Exception):
    """The stream to a target ended in an error (unreachable, deadline, refused); its message
    says which. The rest of that target's entries are not sent; other targets go on."""


class HandoffPort(Protocol):
    """Streams a hand-off to one target."""

    async def send(self, target: Target, pieces: AsyncIterator[Piece], timeout_s: float) -> Receipt:
        """Send `pieces` on one stream to `target`, within `timeout_s`; its reply, or
        HandoffFailed."""
        ...


@dataclass(frozen=True, slots=True)
class TargetOutcome:
    target: Target
    entries: int
    nbytes: int
    receipt: Receipt | None
    error: str = ""


@dataclass(frozen=True, slots=True)
class HandoffSettings:
    budget_s: float  # the configured budget; a drain's grace may cut it (`within`)
    bytes_per_s: float
    max_entries: int
    chunk_bytes: int

    @classmethod
    def of(cls, cfg: RankerConfig) -> "HandoffSettings":
        """A ranker configuration's hand-off settings (the server's and the simulator's)."""
        return cls(cfg.handoff_budget_s, cfg.handoff_bytes_per_s, cfg.handoff_max_entries,
                   CHUNK_BYTES)  # fmt: skip

    def within(self, grace_s: float | None) -> float:
        """The hand-off's time budget in a drain of `grace_s` (None: no limit): the one place
        the budget meets the grace."""
        return self.budget_s if grace_s is None else min(grace_s, self.budget_s)


class HandoffSender:
    """Streams a draining ranker's most valuable prefixes to their next owners.

    One stream per target, all at once, under one shared `Bandwidth`; each stream sends its
    entries in value order. An entry is sent only if, at the bound rate, it is through before
    the time budget ends; what does not fit is not sent (its user misses and recomputes). A
    target's failure ends its stream alone. Entries are read from the store on the event loop
    (their tensors are never written in place) and encoded in a worker thread.
    """

    def __init__(
        self,
        holder: PrefixHolder[PrefixKV],
        port: HandoffPort,
        settings: HandoffSettings,
        stats: HandoffStats,
        traceparent: Callable[[Origin | None], str] = lambda _: "",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        encode_in_thread: bool = True,
    ) -> None:
        self._holder = holder
        self._port = port
        self._settings = settings
        self.stats = stats
        self._traceparent = traceparent
        self._clock = clock
        self._sleep = sleep
        self._thread = encode_in_thread

    async def hand_off(
        self,
        view: Mapping[str, RankerRecord],
        self_id: str,
        model_version: str,
        budget_s: float | None = None,
    ) -> list[TargetOutcome]:
        """Hand the held prefixes to their successors in `view`, within `budget_s` (None: the
        configured budget)."""
        start = self._clock()
        budget = self._settings.within(budget_s)
        deadline = start + budget
        ordered = self._holder.handoff_order()
        routes = plan(ordered, view, self_id, model_version, self._settings.max_entries)
        self.stats.unsent_entries += len(ordered) - sum(len(v) for v in routes.values())
        bandwidth = Bandwidth(self._settings.bytes_per_s, self._clock)
        outcomes = await asyncio.gather(
            *(self._stream(t, entries, bandwidth, deadline) for t, entries in routes.items())
        )
        self.stats.send_seconds += self._clock() - start
        return list(outcomes)

    async def _stream(
        self, target: Target, entries: list[Candidate], bandwidth: Bandwidth, deadline: float
    ) -> TargetOutcome:
        sent = [0, 0]  # entries, bytes

        async def pieces() -> AsyncIterator[Piece]:
            for c in entries:
                if bandwidth.done_at(c.nbytes) > deadline:
                    continue  # not through in time at the bound rate: a smaller one may be
                found = self._read(c)
                if found is None:
                    continue  # consumed, superseded or evicted since the plan
                key, kv, origin = found
                header, payload = await self._encode(key, kv, self._traceparent(origin))
                yield header
                for piece in chunks(payload, self._settings.chunk_bytes):
                    await self._sleep(bandwidth.reserve(len(piece)))
                    yield piece
                sent[0] += 1
                sent[1] += header.nbytes
                self.stats.sent_entries += 1
                self.stats.sent_bytes += header.nbytes

        timeout = max(deadline - self._clock(), 0.0)
        try:
            receipt = await self._port.send(target, pieces(), timeout)
        except HandoffFailed as err:
            self.stats.failed_streams += 1
            self.stats.unsent_entries += len(entries) - sent[0]
            _log.warning("hand-off to %s ended: %s", target.instance_id, err)
            return TargetOutcome(target, sent[0], sent[1], None, str(err))
        self.stats.unsent_entries += len(entries) - sent[0]
        return TargetOutcome(target, sent[0], sent[1], receipt)

    def _read(self, c: Candidate) -> tuple[CacheKey, PrefixKV, Origin | None] | None:
        entry = self._holder.held_for_peer(c.key)
        return None if entry is None else (entry.key, entry.kv, entry.origin)

    async def _encode(
        self, key: CacheKey, kv: PrefixKV, traceparent: str
    ) -> tuple[EntryHeader, bytes]:
        if self._thread:
            return await asyncio.to_thread(encode, key, kv, traceparent)
        return encode(key, kv, traceparent)
