"""One ranker on the virtual clock: the real KV store, the real scheduler's queues and the engine's
own choices (`services.ranker.plan`), with each step taking the time the device profile says.

The flow mirrors `services.ranker.engine.RankerEngine` request for request (single flight per
cache key, PreInfer pins, a Rank hits, waits for and promotes, takes over, or computes), with
callbacks where the engine awaits. tests/unit/sim/test_agreement.py replays one event sequence
through both and checks that they decide alike.
"""

import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeVar

from relaygr.behaviours import UserId
from relaygr.cluster import RankerRecord
from relaygr.errors import DeadlineExceeded, RelayGRError, ResourceExhausted, Unavailable
from relaygr.room import RoomReport
from relaygr.sim.events import EventLoop
from relaygr.sim.profile import DeviceProfile
from relaygr.sim.workload import Visit
from services.ranker.core_types import CoreSettings
from services.ranker.digest import PrefixDigest
from services.ranker.kv_store import CacheKey, KVStore, Tier
from services.ranker.outcomes import CacheOutcome, PreInferOutcome
from services.ranker.plan import (
    PRE_INFER_OUTCOME,
    RANK_OUTCOME,
    Costed,
    Held,
    Source,
    cheapest,
    sooner,
)
from services.ranker.prefix_kv import ModelVersion
from services.ranker.scheduler import ComputeScheduler, Job, Priority

MODEL_VERSION = ModelVersion("sim")


class Status(StrEnum):
    """A simulated call's status, named as gRPC names them."""

    OK = "OK"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"


def status_of(err: BaseException) -> Status:
    if isinstance(err, ResourceExhausted):
        return Status.RESOURCE_EXHAUSTED
    if isinstance(err, DeadlineExceeded):
        return Status.DEADLINE_EXCEEDED
    return Status.UNAVAILABLE


@dataclass(frozen=True, slots=True)
class SimKV:
    """A prefix cache as the simulator keeps it: its size, not its tensors."""

    num_behaviours: int
    num_tokens: int
    nbytes: int
    on_device: bool = True


@dataclass(frozen=True, slots=True)
class PreInferReply:
    status: Status
    outcome: PreInferOutcome | None = None
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class RankReply:
    status: Status
    outcome: CacheOutcome | None = None
    computed_tokens: int = 0
    relayed: bool = False


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """Bytes a ranker's prefix caches hold: in the device tier (of which `device_pinned_bytes`
    are relays pinned for their Rank) and in the host tier."""

    device_bytes: int = 0
    device_pinned_bytes: int = 0
    host_bytes: int = 0

    def peak(self, other: "MemoryUse") -> "MemoryUse":
        """The larger of each figure."""
        return MemoryUse(
            max(self.device_bytes, other.device_bytes),
            max(self.device_pinned_bytes, other.device_pinned_bytes),
            max(self.host_bytes, other.host_bytes),
        )


R = TypeVar("R")
Landed = Callable[[SimKV | None, Exception | None], None]


class Ranker(Protocol):
    """What the fleet needs of a ranker: `SimRanker`, or a real engine behind an adapter."""

    instance_id: str
    alive: bool
    draining: bool
    busy_s: float

    def room(self) -> RoomReport: ...

    def memory(self) -> MemoryUse: ...

    def pre_infer(
        self,
        visit: Visit,
        window_s: float,
        rank_in_s: float | None,
        deadline: float | None,
        reply: Callable[[PreInferReply], None],
    ) -> None: ...

    def rank(
        self, visit: Visit, deadline: float | None, reply: Callable[[RankReply], None]
    ) -> None: ...

    def kill(self) -> None: ...


def ranker_record(instance_id: str, index: int, profile: DeviceProfile) -> RankerRecord:
    """What a ranker of `profile` registers in membership."""
    c = profile.cost
    return RankerRecord(
        instance_id,
        f"sim-{index}:50061",
        MODEL_VERSION,
        profile.device_tier_bytes,
        profile.host_tier_bytes,
        profile.kv_bytes_per_token,
        c.fixed_ms,
        c.per_token_ms,
        c.per_pair_ms,
        c.per_candidate_key_ms,
        c.reload_ms_per_mb,
    )


@dataclass(eq=False, slots=True)
class _Flight:
    job: Job
    source: Source
    computed_tokens: int
    relay: bool
    waiters: list[Landed] = field(default_factory=list)
    taken_over: bool = False


class SimRanker:
    """A ranker instance: PreInfer and Rank answered through callbacks on the loop's clock.

    `kill` ends it at once: every call it has not answered gets UNAVAILABLE, as a client of a
    dead process sees; `drain` refuses new pre-inference. Work runs one step at a time on one
    virtual worker, in the scheduler's order; a step takes its predicted time spread by the
    profile's `compute_noise`.
    """

    def __init__(
        self,
        instance_id: str,
        loop: EventLoop,
        profile: DeviceProfile,
        settings: CoreSettings,
        max_queued: dict[Priority, int],
        dram_ttl_s: float,
        rng: random.Random,
    ) -> None:
        self.instance_id = instance_id
        self.loop = loop
        self.profile = profile
        self.cost = profile.cost
        self.settings = settings
        self.rng = rng
        self.store: KVStore[SimKV] = KVStore(
            profile.device_tier_bytes,
            profile.host_tier_bytes,
            dram_ttl_s,
            loop.clock,
            lambda kv: SimKV(kv.num_behaviours, kv.num_tokens, kv.nbytes, on_device=False),
        )
        self.scheduler = ComputeScheduler(max_queued, clock=loop.clock)
        self.alive = True
        self.draining = False
        self.busy_s = 0.0  # virtual seconds the worker computed
        self._inflight: dict[CacheKey, _Flight] = {}
        self._running: Job | None = None
        self._unanswered: dict[int, Callable[[Status], None]] = {}
        self._calls = 0

    # -- what it publishes ------------------------------------------------------------------

    def room(self) -> RoomReport:
        """What Describe reports of its relay room."""
        usage = self.store.usage(Tier.HBM)
        queued = self.scheduler.queued_background_ms()
        return RoomReport(usage.pinned_bytes, usage.budget_bytes, queued)

    def memory(self) -> MemoryUse:
        """What its tiers hold now."""
        device, host = self.store.usage(Tier.HBM), self.store.usage(Tier.DRAM)
        return MemoryUse(device.used_bytes, device.pinned_bytes, host.used_bytes)

    # -- PreInfer ---------------------------------------------------------------------------

    def pre_infer(
        self,
        visit: Visit,
        window_s: float,
        rank_in_s: float | None,
        deadline: float | None,
        reply: Callable[[PreInferReply], None],
    ) -> None:
        if not self.alive:  # a dead process: the caller's connection fails at once
            reply(PreInferReply(Status.UNAVAILABLE))
            return
        call = self._call(lambda status: reply(PreInferReply(status)))
        answer = self._answer(call, reply)
        try:
            if self.draining:
                raise Unavailable("ranker is draining")
            if not self.settings.relay_enabled:
                raise Unavailable("relay is disabled on this ranker")
            key = self._key(visit)
            if self.store.get(key, Tier.HBM) is not None:
                answer(self._pin(key, window_s, PreInferOutcome.ALREADY_RESIDENT))
                return
            flight = self._inflight.get(key)
            if flight is None:
                nbytes = visit.prefix_tokens * self.profile.kv_bytes_per_token
                if not self.store.fits_device(nbytes):
                    raise ResourceExhausted("the device tier has no room beside pinned relays")
                due = self.loop.now + (rank_in_s or window_s)
                flight = self._start(key, visit, Priority.BACKGROUND, deadline, window_s, due)
                joined = False
            else:
                joined = True
        except RelayGRError as err:
            answer(PreInferReply(status_of(err)))
            return

        def landed(kv: SimKV | None, err: Exception | None) -> None:
            if err is not None:
                answer(PreInferReply(status_of(err)))
                return
            assert flight is not None
            if joined or flight.taken_over:
                outcome = PreInferOutcome.JOINED_INFLIGHT
            else:
                outcome = PRE_INFER_OUTCOME[flight.source]
            answer(self._pin(key, window_s, outcome))

        flight.waiters.append(landed)

    def _pin(self, key: CacheKey, window_s: float, outcome: PreInferOutcome) -> PreInferReply:
        kv = self.store.get(key, Tier.HBM)
        if kv is None or not self.store.put_device(key, kv, pin_for=window_s):
            return PreInferReply(Status.RESOURCE_EXHAUSTED)
        return PreInferReply(Status.OK, outcome, kv.nbytes)

    # -- Rank -------------------------------------------------------------------------------

    def rank(
        self, visit: Visit, deadline: float | None, reply: Callable[[RankReply], None]
    ) -> None:
        if not self.alive:
            reply(RankReply(Status.UNAVAILABLE))
            return
        call = self._call(lambda status: reply(RankReply(status)))
        answer = self._answer(call, reply)
        candidates = visit.candidates
        try:
            if not self.settings.relay_enabled:
                full = self.cost.full_ms(visit.history_tokens, candidates)
                computed = visit.history_tokens + candidates
                self._run_rank(
                    full, deadline, answer, RankReply(Status.OK, CacheOutcome.BYPASS, computed)
                )
                return
            key = self._key(visit)
            kv = self.store.get(key, Tier.HBM)
            held = self.store.peek(key, Tier.HBM)
            relayed = held is not None and held.pinned
            computed = visit.short_term + candidates
            if kv is not None:
                self._score(
                    key, kv, visit, deadline, answer, CacheOutcome.HBM_HIT, computed, relayed
                )
                return
            flight = self._inflight.get(key)
            if flight is not None and not self._take_over(key, flight, visit, deadline):
                self.scheduler.promote(flight.job, deadline)
                waited = flight

                def after_wait(kv: SimKV | None, err: Exception | None) -> None:
                    if kv is not None:
                        self._score(
                            key, kv, visit, deadline, answer,
                            CacheOutcome.WAITED_INFLIGHT, computed, waited.relay,
                        )  # fmt: skip
                    elif isinstance(err, DeadlineExceeded):  # its pre-infer gave up: compute
                        self._compute(key, visit, deadline, answer, computed)
                    else:
                        answer(RankReply(status_of(err or Unavailable("lost"))))

                flight.waiters.append(after_wait)
                return
            if flight is not None:  # taken over: its job is now this Rank's computation
                self._await_own(flight, key, visit, deadline, answer, computed)
                return
            self._compute(key, visit, deadline, answer, computed)
        except RelayGRError as err:
            answer(RankReply(status_of(err)))

    def _compute(
        self,
        key: CacheKey,
        visit: Visit,
        deadline: float | None,
        answer: Callable[[RankReply], None],
        computed: int,
    ) -> None:
        try:
            flight = self._start(key, visit, Priority.RANK, deadline, None)
        except RelayGRError as err:
            answer(RankReply(status_of(err)))
            return
        self._await_own(flight, key, visit, deadline, answer, computed)

    def _await_own(
        self,
        flight: _Flight,
        key: CacheKey,
        visit: Visit,
        deadline: float | None,
        answer: Callable[[RankReply], None],
        computed: int,
    ) -> None:
        def landed(kv: SimKV | None, err: Exception | None) -> None:
            if kv is None:
                answer(RankReply(status_of(err or Unavailable("lost"))))
                return
            outcome = RANK_OUTCOME[flight.source]
            total = computed + flight.computed_tokens
            self._score(key, kv, visit, deadline, answer, outcome, total, False)

        flight.waiters.append(landed)

    def _score(
        self,
        key: CacheKey,
        kv: SimKV,
        visit: Visit,
        deadline: float | None,
        answer: Callable[[RankReply], None],
        outcome: CacheOutcome,
        computed: int,
        relayed: bool,
    ) -> None:
        ms = self.cost.rank_ms(kv.num_tokens, visit.short_term, visit.candidates)

        def consumed() -> None:
            self.store.consume(key)

        self._run_rank(
            ms, deadline, answer, RankReply(Status.OK, outcome, computed, relayed), consumed
        )

    def _run_rank(
        self,
        ms: float,
        deadline: float | None,
        answer: Callable[[RankReply], None],
        ok: RankReply,
        then: Callable[[], None] = lambda: None,
    ) -> None:
        try:
            job = self.scheduler.submit(
                "rank", _steps(1, None), Priority.RANK, deadline, step_ms=(ms,)
            )
        except RelayGRError as err:
            answer(RankReply(status_of(err)))
            return

        def done(_: object) -> None:
            err = job.future.exception()
            if err is not None:
                answer(RankReply(status_of(err)))
                return
            then()
            answer(ok)

        job.future.add_done_callback(done)
        self._kick()

    def _take_over(
        self, key: CacheKey, flight: _Flight, visit: Visit, deadline: float | None
    ) -> bool:
        """The engine's `_take_over`: restart a queued background job as this Rank's one call
        when that is predicted sooner than its remaining chunks."""
        job = flight.job
        if job.priority is not Priority.BACKGROUND:
            return False
        costed = self._costed(key, visit, None)
        if not sooner(sum(costed.step_ms), job.remaining_ms):
            return False
        steps = _steps(len(costed.step_ms), self._result(visit))
        if not self.scheduler.restart(job, steps, costed.step_ms, deadline):
            return False
        flight.source, flight.computed_tokens = costed.source, costed.computed_tokens
        flight.relay, flight.taken_over = False, True
        return True

    # -- lifecycle --------------------------------------------------------------------------

    def kill(self) -> None:
        """The process dies: nothing it held survives, every unanswered call fails."""
        self.alive = False
        unanswered, self._unanswered = self._unanswered, {}
        for fail in unanswered.values():
            fail(Status.UNAVAILABLE)
        self._inflight.clear()
        self._running = None

    # -- internals --------------------------------------------------------------------------

    def _call(self, fail: Callable[[Status], None]) -> int:
        self._calls += 1
        self._unanswered[self._calls] = fail
        return self._calls

    def _answer(self, call: int, reply: Callable[[R], None]) -> Callable[[R], None]:
        """`reply`, once, unless the ranker died first (then the kill answered it)."""

        def answer(value: R) -> None:
            if self._unanswered.pop(call, None) is not None:
                reply(value)

        return answer

    def _key(self, visit: Visit) -> CacheKey:
        # Histories only grow, so the long-term length identifies a user's prefix.
        return CacheKey(UserId(visit.user), MODEL_VERSION, PrefixDigest(str(visit.behaviours)))

    def _extendable(self, key: CacheKey, visit: Visit) -> SimKV | None:
        for old in self.store.user_keys(key.user_id, key.model_version):
            tier = self.store.tier_of(old)
            entry = self.store.peek(old, tier) if tier is not None else None
            if entry is not None and entry.kv.num_behaviours < visit.behaviours:
                return entry.kv
        return None

    def _costed(self, key: CacheKey, visit: Visit, chunk: int | None) -> Costed:
        held = self.store.peek(key, Tier.DRAM)
        base = self._extendable(key, visit)
        return cheapest(
            self.cost,
            visit.user_features,
            visit.behaviours,
            None if held is None else _held(held.kv),
            None if base is None else _held(base),
            chunk,
        )

    def _result(self, visit: Visit) -> SimKV:
        tokens = visit.prefix_tokens
        return SimKV(visit.behaviours, tokens, tokens * self.profile.kv_bytes_per_token)

    def _start(
        self,
        key: CacheKey,
        visit: Visit,
        priority: Priority,
        deadline: float | None,
        pin_for: float | None,
        due: float | None = None,
    ) -> _Flight:
        chunk = self.settings.prefill_chunk_tokens if priority is Priority.BACKGROUND else None
        costed = self._costed(key, visit, chunk)
        steps = _steps(len(costed.step_ms), self._result(visit))
        job = self.scheduler.submit(
            f"{costed.source}:{visit.user}",
            steps,
            priority,
            deadline,
            due=due,
            step_ms=costed.step_ms,
        )
        flight = _Flight(job, costed.source, costed.computed_tokens, pin_for is not None)
        self._inflight[key] = flight
        job.future.add_done_callback(lambda _: self._land(key, flight, pin_for))
        self._kick()
        return flight

    def _land(self, key: CacheKey, flight: _Flight, pin_for: float | None) -> None:
        if not self.alive:
            return
        err = flight.job.future.exception()
        kv: SimKV | None = None
        if err is None:
            kv = flight.job.future.result()
            assert kv is not None
            self.store.put_device(key, kv, pin_for=pin_for)
        if self._inflight.get(key) is flight:
            del self._inflight[key]
        for waiter in flight.waiters:
            waiter(kv, err if isinstance(err, Exception) else None)

    def _kick(self) -> None:
        """Start the next step if the worker is idle."""
        if self._running is not None or not self.alive:
            return
        job = self.scheduler.take()
        if job is None:
            return
        self._running = job
        seconds = job.next_step_ms / 1e3
        noise = self.profile.compute_noise
        if noise:
            seconds *= max(0.0, self.rng.gauss(1.0, noise))
        self.busy_s += seconds
        self.loop.after(seconds, self._stepped, job)

    def _stepped(self, job: Job) -> None:
        if self._running is not job:
            return  # killed meanwhile
        self._running = None
        self.scheduler.step(job)
        self._kick()


def _held(kv: SimKV) -> Held:
    return Held(kv.num_behaviours, kv.num_tokens, kv.nbytes, kv.on_device)


def _steps(n: int, result: SimKV | None) -> Generator[None, None, SimKV | None]:
    """A job of `n` steps that computes nothing and returns `result`."""
    for _ in range(n - 1):
        yield
    return result
