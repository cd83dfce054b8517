"""Each ranker's relay room as one process sees it: the trigger and the router keep the same books.

Pure: no I/O, time passed in as `now` (seconds of one clock, any origin). `relaygr.room_poll`
fills a `RelayRoom` from the rankers' Describe; the owner books the relays it starts and the
refusals it meets.
"""

import bisect
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from relaygr.cluster import RankerRecord


@dataclass(frozen=True, slots=True)
class RoomReport:
    """What a ranker said of its relay room (Describe): the device tier's pinned bytes and budget
    (the ranker pins a relay only while pinned + its bytes <= budget) and the predicted compute
    time of the background prefill, and of the rank work, queued or running."""

    pinned_bytes: int
    budget_bytes: int
    queued_prefill_ms: float = 0.0
    queued_rank_ms: float = 0.0
    # How the ranker's relays have ended since it started: consumed by a Rank, or unpinned when
    # their relay window ended with no Rank (a no-show, as far as the ranker can tell).
    relays_consumed: int = 0
    relays_unconsumed: int = 0
    # The 99th percentile of its latest relays' waits for their Rank, ms (0: unknown).
    relay_wait_p99_ms: float = 0.0


@dataclass(slots=True)
class RelayEnds:
    """How relays ended lately across the rankers observed: consumed by their Rank, or expired
    unconsumed. Counts decay by half every `half_life_s`, so the share follows a workload whose
    no-shows change. `no_show_share` blends a prior worth `prior_relays` ends with what was
    seen: the prior until relays end, the measurement once many have."""

    half_life_s: float = 30.0
    consumed: float = 0.0
    unconsumed: float = 0.0
    at: float | None = None

    def add(self, consumed: int, unconsumed: int, now: float) -> None:
        if self.at is not None and now > self.at:
            keep = math.exp2(-(now - self.at) / self.half_life_s)
            self.consumed *= keep
            self.unconsumed *= keep
        self.at = now if self.at is None else max(self.at, now)
        self.consumed += consumed
        self.unconsumed += unconsumed

    def no_show_share(self, prior: float, prior_relays: float) -> float:
        seen = self.consumed + self.unconsumed
        return (self.unconsumed + prior * prior_relays) / (seen + prior_relays)


@dataclass(slots=True)
class Relay:
    """A relay this process started: in flight until settled, then resident until it expires."""

    instance: str
    nbytes: int
    expires_at: float
    prefill_ms: float = 0.0  # its predicted prefill on `instance`
    admitted_at: float = 0.0
    settled_at: float | None = None  # when its PreInfer came back; None while in flight
    observed: bool = False  # a later observation of its ranker already counts its bytes
    prefill_observed: bool = False  # ... and its prefill (queued then, or done)
    due_at: float = math.inf  # when its Rank is expected (inf: unknown)
    window_s: float | None = None  # the pin it asked for (None: the room's `window_s`)


@dataclass(frozen=True, slots=True)
class _Observation:
    report: RoomReport
    at: float  # when the question was sent


@dataclass(frozen=True, slots=True)
class _Due:
    """The relays an instance's last observation counted pinned before their Rank was due:
    their due times in order, and the bytes due by each (running sums)."""

    at: list[float]
    nbytes_by: list[int]

    @classmethod
    def of(cls, relays: list[Relay]) -> "_Due":
        relays = sorted(relays, key=lambda r: r.due_at)
        return cls([r.due_at for r in relays], list(itertools.accumulate(r.nbytes for r in relays)))

    def nbytes(self, now: float) -> int:
        """Bytes of these relays whose Rank was due by `now`."""
        i = bisect.bisect_right(self.at, now)
        return self.nbytes_by[i - 1] if i else 0


@dataclass(frozen=True, slots=True)
class _Refusal:
    at: float
    until: float


@dataclass(slots=True)
class RelayRoom:
    """Relays started here and the room last observed on each ranker.

    A relay is keyed by an owner-chosen key (the trigger: user id and prefix digest): a user's
    newer prefix is a new relay, and the older one keeps its bytes until released, as the ranker
    keeps pinned relays of a user.

    Bytes: an instance holds its last observed pinned bytes, while that observation is fresh
    (taken less than `window_s` ago: by then every pin it counted has been consumed or has
    expired, so an older one says nothing, "unknown"), plus the relays not yet covered by an
    observation. A relay is covered once an observation sent after it settled comes back: its
    bytes are then in the observed figure if still pinned, or gone if its Rank consumed it. A
    relay's bytes are released when it fails, expires, or is covered.

    A relay's Rank is due at `due_at`: an observation sent before then counted it pinned, and
    once it is due, `held` may take the share of such relays whose Rank comes (`ranked`) as
    consumed already, rather than wait for the next observation to show them gone.

    Prefill: an instance's queue is its last fresh observation's `queued_prefill_ms` plus the
    prefill of relays admitted at or after that observation was sent (earlier ones were queued
    or done when it was answered). A failed relay's prefill is released at once.

    Refusals: an instance that refused a relay for room is full until an observation sent
    after the refusal comes back, or `refusal_s` passes (its Describe may keep failing). An
    observation older than the one held is ignored.

    Ends: each observation adds to `ends` the relays its instance saw consumed and expired
    since the one before (a count that went down is a restarted ranker's: counted from zero).
    """

    window_s: float
    refusal_s: float = 1.0
    relays: dict[Hashable, Relay] = field(default_factory=dict)
    observed: dict[str, _Observation] = field(default_factory=dict)
    refusals: dict[str, _Refusal] = field(default_factory=dict)
    due: dict[str, _Due] = field(default_factory=dict)  # per instance, of its observation
    ends: RelayEnds = field(default_factory=RelayEnds)
    # Kept in step with `relays` so that a decision costs O(log n), not a scan: the uncovered
    # and the unsettled bytes and the prefill per instance, and a heap of (expires_at, key)
    # whose stale entries are skipped.
    _uncovered: Counter[str] = field(default_factory=Counter)
    _unsettled: Counter[str] = field(default_factory=Counter)
    _unqueued: dict[str, float] = field(default_factory=dict)
    _expiries: list[tuple[float, int, Hashable]] = field(default_factory=list)
    _on: dict[str, dict[Hashable, None]] = field(default_factory=dict)  # instance -> its relays
    _pushes: int = 0  # tie-breaker: keys need not be ordered
    _tail: tuple[float, float] = (0.0, -math.inf)  # the latest relay-wait tail reported, and when

    # -- the view -------------------------------------------------------------------------

    def report(self, instance: str, now: float) -> RoomReport | None:
        """The instance's last observation while fresh; None: unknown."""
        seen = self.observed.get(instance)
        if seen is None or now >= seen.at + self.window_s:
            return None
        return seen.report

    def wait_tail_ms(self, instance: str, now: float) -> float:
        """The 99th-percentile wait of a relay for its Rank on the instance, as last reported
        while fresh; else the latest any ranker reported while fresh, since the gap is the
        callers' and the same whichever ranker a relay lands on (a ranker that consumed too few
        relays to time them borrows it); 0: none known."""
        seen = self.report(instance, now)
        if seen is not None and seen.relay_wait_p99_ms > 0:
            return seen.relay_wait_p99_ms
        tail_ms, at = self._tail
        return tail_ms if now < at + self.window_s else 0.0

    def held(self, instance: str, now: float, ranked: float = 0.0) -> float:
        """Bytes pinned on the instance, as far as this process knows: `ranked` (the share of
        relays whose Rank comes) of the relays its observation counted pinned and whose Rank
        is due by now taken as consumed."""
        self._expire(now)
        seen = self.report(instance, now)
        if seen is None:
            return self._uncovered[instance]
        due = self.due.get(instance)
        consumed = 0.0 if due is None or not ranked else ranked * due.nbytes(now)
        return seen.pinned_bytes - consumed + self._uncovered[instance]

    def in_flight(self, instance: str, now: float) -> int:
        """Bytes of the relays started here for the instance and not yet settled: accepted or
        on their way, their prefill not yet done, so pinned nowhere yet and counted by no
        ranker's own check (`KVStore.fits_device` counts what is pinned)."""
        self._expire(now)
        return self._unsettled[instance]

    def budget(self, record: RankerRecord) -> int:
        """The instance's relay budget: what it last reported, else what it registered."""
        seen = self.observed.get(record.instance_id)
        return record.hbm_budget_bytes if seen is None else seen.report.budget_bytes

    def queued_ms(self, instance: str, now: float) -> float:
        """Predicted background prefill ahead of a relay sent to the instance now."""
        seen = self.report(instance, now)
        return (0.0 if seen is None else seen.queued_prefill_ms) + self._unqueued.get(instance, 0.0)

    def queued_rank_ms(self, instance: str, now: float) -> float:
        """Predicted rank work ahead of a Rank sent to the instance now: its last fresh report's,
        taken as the current level (a queue under steady load stays near where it was; an
        unknown instance, 0)."""
        seen = self.report(instance, now)
        return 0.0 if seen is None else seen.queued_rank_ms

    def refused(self, instance: str, now: float) -> bool:
        refusal = self.refusals.get(instance)
        return refusal is not None and now < refusal.until

    def fits(self, record: RankerRecord, nbytes: int, now: float) -> bool:
        """Would `nbytes` more fit the instance's relay budget now (`held`)? Not after a refusal
        not yet cleared. (The router orders a PreInfer's rankers by it.)"""
        instance = record.instance_id
        if self.refused(instance, now):
            return False
        return self.held(instance, now) + nbytes <= self.budget(record)

    # -- relays ---------------------------------------------------------------------------

    def live(self, key: Hashable, now: float) -> Relay | None:
        self._expire(now)
        return self.relays.get(key)

    def start(self, key: Hashable, relay: Relay) -> None:
        self._remove(key)
        self._add(key, relay)

    def settle(self, key: Hashable, instance: str, nbytes: int, now: float) -> None:
        """The relay's PreInfer came back: it is pinned on `instance` for its window from now.
        Its prefill, done, stays booked until an observation covers it (the queue figure
        reported before then may still count it)."""
        relay = self._remove(key)
        if relay is None:
            return  # failed or swept meanwhile
        # Served elsewhere (the router fell back): that ranker ran the prefill, which is done.
        moved = relay.instance != instance
        window_s = self.window_s if relay.window_s is None else relay.window_s
        self._add(
            key,
            Relay(
                instance, nbytes, now + window_s, relay.prefill_ms, relay.admitted_at, now,
                prefill_observed=relay.prefill_observed or moved, due_at=relay.due_at,
                window_s=relay.window_s,
            ),
        )  # fmt: skip

    def landed(self, key: Hashable, instance: str, nbytes: int, now: float) -> None:
        """A relay seen only once resident (the router books what it placed): pinned on
        `instance` for a window from now."""
        relay = Relay(instance, nbytes, now + self.window_s, 0.0, now, now, prefill_observed=True)
        self.start(key, relay)

    def fail(self, key: Hashable) -> None:
        self._remove(key)

    # -- learning -------------------------------------------------------------------------

    def refuse(self, instance: str, now: float, until: float | None = None) -> None:
        """The instance refused a relay for want of room: full until an observation sent
        after now, or `until` (default: `refusal_s` from now)."""
        self.refusals[instance] = _Refusal(now, now + self.refusal_s if until is None else until)

    def observe(self, instance: str, report: RoomReport, sent_at: float) -> None:
        """The instance answered `report` when asked at `sent_at`."""
        seen = self.observed.get(instance)
        if seen is not None and sent_at < seen.at:
            return  # a late answer to an older question
        if seen is not None:
            self.ends.add(
                _since(seen.report.relays_consumed, report.relays_consumed),
                _since(seen.report.relays_unconsumed, report.relays_unconsumed),
                sent_at,
            )
        self.observed[instance] = _Observation(report, sent_at)
        if report.relay_wait_p99_ms > 0 and sent_at >= self._tail[1]:
            self._tail = (report.relay_wait_p99_ms, sent_at)
        refusal = self.refusals.get(instance)
        if refusal is not None and refusal.at < sent_at:
            del self.refusals[instance]
        pinned_before_due = []
        for key in self._on.get(instance, ()):
            relay = self.relays[key]
            if not relay.prefill_observed and relay.admitted_at < sent_at:
                relay.prefill_observed = True
                self._unqueue(instance, relay.prefill_ms)
            covered = relay.settled_at is not None and relay.settled_at <= sent_at
            if covered and not relay.observed:
                relay.observed = True
                self._uncover(relay)
            if covered and sent_at < relay.due_at < math.inf:
                pinned_before_due.append(relay)
        if pinned_before_due:
            self.due[instance] = _Due.of(pinned_before_due)
        else:
            self.due.pop(instance, None)

    def sweep(self, now: float, instances: Mapping[str, object]) -> None:
        """Forget expired relays, and relays, observations and refusals of rankers that left."""
        self._expire(now)
        for key in [k for k, r in self.relays.items() if r.instance not in instances]:
            self._remove(key)
        for table in (self.observed, self.refusals, self.due):
            for instance in [i for i in table if i not in instances]:
                del table[instance]

    # -- internals ------------------------------------------------------------------------

    def _add(self, key: Hashable, relay: Relay) -> None:
        self.relays[key] = relay
        self._on.setdefault(relay.instance, {})[key] = None
        if not relay.observed:
            self._uncovered[relay.instance] += relay.nbytes
        if relay.settled_at is None:
            self._unsettled[relay.instance] += relay.nbytes
        if not relay.prefill_observed:
            self._unqueued[relay.instance] = (
                self._unqueued.get(relay.instance, 0.0) + relay.prefill_ms
            )
        self._pushes += 1
        heapq.heappush(self._expiries, (relay.expires_at, self._pushes, key))

    def _remove(self, key: Hashable) -> Relay | None:
        relay = self.relays.pop(key, None)
        if relay is None:
            return None
        mine = self._on[relay.instance]
        del mine[key]
        if not mine:
            del self._on[relay.instance]
        if not relay.observed:
            self._uncover(relay)
        if relay.settled_at is None:
            self._unsettled[relay.instance] -= relay.nbytes
            if not self._unsettled[relay.instance]:
                del self._unsettled[relay.instance]
        if not relay.prefill_observed:
            self._unqueue(relay.instance, relay.prefill_ms)
        return relay

    def _uncover(self, relay: Relay) -> None:
        self._uncovered[relay.instance] -= relay.nbytes
        if not self._uncovered[relay.instance]:
            del self._uncovered[relay.instance]

    def _unqueue(self, instance: str, prefill_ms: float) -> None:
        left = self._unqueued.get(instance, 0.0) - prefill_ms
        if left > 1e-9:
            self._unqueued[instance] = left
        else:  # the last one (a float sum may leave a tiny residue)
            self._unqueued.pop(instance, None)

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expires_at, _, key = heapq.heappop(self._expiries)
            relay = self.relays.get(key)
            if relay is not None and relay.expires_at == expires_at:  # else a stale entry
                self._remove(key)


def _since(before: int, now: int) -> int:
    """How much a counter since start grew between two reads; one that went down restarted."""
    return now - before if now >= before else now
