"""Sequence-aware admission: relay only at-risk requests, within footprint and prefill budgets.

Pure policy: no I/O, time passed in as `now` (seconds, any monotonic origin). The service feeds
it retrieval events, dispatch outcomes and rankers' observed pinned bytes.
"""

import dataclasses
import enum
import heapq
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from relaygr.cluster import RankerRecord
from services.trigger.config import Mode, TriggerConfig


class Reason(enum.StrEnum):
    """Why an event was or was not admitted; the names match relaygr.v1.AdmissionReason."""

    ADMITTED = "admitted"
    NOT_AT_RISK = "not_at_risk"
    FOOTPRINT_LIMIT = "footprint_limit"
    LOAD_LIMIT = "load_limit"
    ALREADY_CACHED = "already_cached"
    IN_FLIGHT = "in_flight"
    RELAY_DISABLED = "relay_disabled"
    NO_RANKER = "no_ranker"


@dataclass(frozen=True, slots=True)
class Event:
    """A retrieval event as the policy sees it. `digest` returns the prefix's identity (the
    service's cheap fingerprint); it is called only for events that may be relayed."""

    user_id: str
    prefix_tokens: int  # user features + long-term behaviours
    short_term: int  # expected short-term behaviours at ranking time
    candidates: int  # expected candidates
    digest: Callable[[], str]


@dataclass(frozen=True, slots=True)
class Decision:
    reason: Reason
    predicted_full_ms: float = 0.0  # full inference of the whole expected request
    target: str = ""  # the ranker the relay is expected to land on
    kv_bytes: int = 0  # what the relay would pin there
    prefill_ms: float = 0.0  # what prefilling the prefix costs there
    digest: str = ""  # the prefix's identity, when it was computed

    @property
    def admitted(self) -> bool:
        return self.reason is Reason.ADMITTED


class TokenBucket:
    """A prefill budget refilled at `rate` per second up to `capacity`.

    `take` succeeds while the level is positive and may leave it negative, so a single prefill
    larger than the capacity is still admitted once the bucket is full. Over any interval of T
    seconds the amounts taken sum to at most capacity + rate * T + the largest single amount.
    """

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate, self.capacity = rate, capacity
        self._level, self._at = capacity, now

    def level(self, now: float) -> float:
        elapsed = max(0.0, now - self._at)
        self._level = min(self.capacity, self._level + elapsed * self.rate)
        self._at = max(self._at, now)
        return self._level

    def take(self, amount: float, now: float) -> bool:
        if self.level(now) <= 0:
            return False
        self._level -= amount
        return True


@dataclass(slots=True)
class Relay:
    """A relay this trigger started: in flight until settled, then resident until it expires."""

    instance: str
    nbytes: int
    expires_at: float
    settled_at: float | None = None  # when its PreInfer came back; None while in flight
    observed: bool = False  # a later observation of its ranker already counts its bytes


@dataclass(frozen=True, slots=True)
class _Observation:
    pinned_bytes: int
    at: float


@dataclass(frozen=True, slots=True)
class _Refusal:
    at: float
    until: float


@dataclass(slots=True)
class RelayLedger:
    """Relays started by this trigger and the pinned bytes last observed on each ranker.

    A relay is keyed by (user id, prefix digest): a user's newer prefix is a new relay, and the
    older one keeps its bytes until released, as the ranker keeps pinned relays of a user.
    The bytes held on an instance are its last observed pinned bytes (valid for one relay
    window after the observation, by which time every pin then held has been consumed or has
    expired) plus the relays not yet covered by an observation. A relay is covered once an
    observation sent after it settled comes back: its bytes are then in the observed figure if
    still pinned, or gone if its Rank consumed it. A relay's bytes are released when it fails,
    expires, or is covered. An observation older than the one held is ignored, and clears a
    refusal only if it was sent after the refusal.
    """

    window_s: float
    relays: dict[tuple[str, str], Relay] = field(default_factory=dict)
    observed: dict[str, _Observation] = field(default_factory=dict)
    refusals: dict[str, _Refusal] = field(default_factory=dict)
    # Kept in step with `relays` so that a decision costs O(log n), not a scan: the uncovered
    # bytes per instance, and a heap of (expires_at, key) whose stale entries are skipped.
    _uncovered: Counter[str] = field(default_factory=Counter)
    _expiries: list[tuple[float, tuple[str, str]]] = field(default_factory=list)

    def held(self, instance: str, now: float) -> int:
        self._expire(now)
        seen = self.observed.get(instance)
        base = seen.pinned_bytes if seen is not None and now < seen.at + self.window_s else 0
        return base + self._uncovered[instance]

    def live(self, user_id: str, digest: str, now: float) -> Relay | None:
        self._expire(now)
        return self.relays.get((user_id, digest))

    def start(self, user_id: str, digest: str, relay: Relay) -> None:
        self._remove((user_id, digest))
        self._add((user_id, digest), relay)

    def settle(self, user_id: str, digest: str, instance: str, nbytes: int, now: float) -> None:
        """The relay's PreInfer came back: it is pinned on `instance` for a window from now."""
        key = (user_id, digest)
        if self._remove(key) is None:
            return  # failed or swept meanwhile
        self._add(key, Relay(instance, nbytes, now + self.window_s, settled_at=now))

    def fail(self, user_id: str, digest: str) -> None:
        self._remove((user_id, digest))

    def _add(self, key: tuple[str, str], relay: Relay) -> None:
        self.relays[key] = relay
        if not relay.observed:
            self._uncovered[relay.instance] += relay.nbytes
        heapq.heappush(self._expiries, (relay.expires_at, key))

    def _remove(self, key: tuple[str, str]) -> Relay | None:
        relay = self.relays.pop(key, None)
        if relay is not None and not relay.observed:
            self._uncover(relay)
        return relay

    def _uncover(self, relay: Relay) -> None:
        self._uncovered[relay.instance] -= relay.nbytes
        if not self._uncovered[relay.instance]:
            del self._uncovered[relay.instance]

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            expires_at, key = heapq.heappop(self._expiries)
            relay = self.relays.get(key)
            if relay is not None and relay.expires_at == expires_at:  # else a stale entry
                self._remove(key)

    def refuse(self, instance: str, now: float, until: float) -> None:
        self.refusals[instance] = _Refusal(now, until)

    def refused(self, instance: str, now: float) -> bool:
        refusal = self.refusals.get(instance)
        return refusal is not None and now < refusal.until

    def observe(self, instance: str, pinned_bytes: int, sent_at: float) -> None:
        """The instance pinned `pinned_bytes` when asked at `sent_at`."""
        seen = self.observed.get(instance)
        if seen is not None and sent_at < seen.at:
            return  # a late answer to an older question
        self.observed[instance] = _Observation(pinned_bytes, sent_at)
        refusal = self.refusals.get(instance)
        if refusal is not None and refusal.at < sent_at:
            del self.refusals[instance]
        for relay in self.relays.values():
            covered = relay.settled_at is not None and relay.settled_at <= sent_at
            if relay.instance == instance and covered and not relay.observed:
                relay.observed = True
                self._uncover(relay)

    def sweep(self, now: float, instances: Mapping[str, object]) -> None:
        """Forget expired relays, and relays, observations and refusals of rankers that left."""
        self._expire(now)
        for key in [k for k, r in self.relays.items() if r.instance not in instances]:
            self._remove(key)
        for table in (self.observed, self.refusals):
            for instance in [i for i in table if i not in instances]:
                del table[instance]


class AdmissionPolicy:
    """Decides which retrieval events to relay, and keeps the books that decision needs.

    Checks, in order (the first that fails is the reason): mode `off` -> RELAY_DISABLED; no
    target ranker -> NO_RANKER; (sequence-aware) predicted full inference within
    slo_ms - margin_ms -> NOT_AT_RISK; the same prefix already relayed -> IN_FLIGHT or
    ALREADY_CACHED; (sequence-aware) its KV bytes would not fit the target's relay budget, or
    the target recently refused a relay -> FOOTPRINT_LIMIT; the target's prefill budget is spent
    -> LOAD_LIMIT. Mode `all` relays every event that is not a duplicate.
    """

    def __init__(self, cfg: TriggerConfig) -> None:
        self.cfg = cfg
        self.ledger = RelayLedger(cfg.relay_window_s)
        self._buckets: dict[str, TokenBucket] = {}

    def reconfigure(self, cfg: TriggerConfig) -> None:
        self.cfg = cfg
        self.ledger.window_s = cfg.relay_window_s
        for bucket in self._buckets.values():
            bucket.rate, bucket.capacity = self._bucket_shape()

    def _bucket_shape(self) -> tuple[float, float]:
        rate = self.cfg.prefill_share * 1000.0  # prefill ms per second of a ranker's time
        return rate, rate * self.cfg.burst_s

    def _bucket(self, instance: str, now: float) -> TokenBucket:
        bucket = self._buckets.get(instance)
        if bucket is None:
            bucket = self._buckets[instance] = TokenBucket(*self._bucket_shape(), now)
        return bucket

    def decide(self, event: Event, target: RankerRecord | None, now: float) -> Decision:
        """Decide on `event`, to be relayed to `target`; an admitted relay is booked at once."""
        cfg = self.cfg
        if cfg.mode is Mode.OFF:
            return Decision(Reason.RELAY_DISABLED)
        if target is None:
            return Decision(Reason.NO_RANKER)
        cost = target.cost_model()
        history = event.prefix_tokens + event.short_term
        predicted = cost.full_ms(history, event.candidates)
        aware = cfg.mode is Mode.SEQUENCE_AWARE
        if aware and predicted <= cfg.slo_ms - cfg.margin_ms:
            return Decision(Reason.NOT_AT_RISK, predicted, target.instance_id)
        digest = event.digest()
        nbytes = event.prefix_tokens * target.kv_bytes_per_token
        prefill_ms = cost.prefill_ms(event.prefix_tokens)
        instance = target.instance_id
        decided = Decision(Reason.ADMITTED, predicted, instance, nbytes, prefill_ms, digest)
        relay = self.ledger.live(event.user_id, digest, now)
        if relay is not None:
            reason = Reason.IN_FLIGHT if relay.settled_at is None else Reason.ALREADY_CACHED
            return dataclasses.replace(decided, reason=reason)
        if aware:
            budget = target.hbm_budget_bytes * cfg.relay_budget_share
            full = self.ledger.held(instance, now) + nbytes > budget
            if full or self.ledger.refused(instance, now):
                return dataclasses.replace(decided, reason=Reason.FOOTPRINT_LIMIT)
            if not self._bucket(instance, now).take(prefill_ms, now):
                return dataclasses.replace(decided, reason=Reason.LOAD_LIMIT)
        expires = now + cfg.relay_window_s  # in flight: until its dispatch deadline at most
        self.ledger.start(event.user_id, digest, Relay(instance, nbytes, expires))
        return decided

    def refused(self, decision: Decision, user_id: str, now: float) -> None:
        """The target refused the relay for want of room: back off from it for a while.

        The prefill budget the relay took is not refunded: the back-off covers the target.
        """
        self.ledger.fail(user_id, decision.digest)
        self.ledger.refuse(decision.target, now, now + self.cfg.refusal_cooldown_ms / 1e3)

    def sweep(self, now: float, instances: Mapping[str, object]) -> None:
        """Forget expired relays and everything about rankers no longer in `instances`."""
        self.ledger.sweep(now, instances)
        for instance in [i for i in self._buckets if i not in instances]:
            del self._buckets[instance]
