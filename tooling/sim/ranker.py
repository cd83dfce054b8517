"""One ranker on the virtual clock: the service's own `RankerCore` (services/ranker/core.py),
driven with each step taking the time the device profile predicts and KV caches as sizes.

The driver decides nothing: PreInfer and Rank go to the core, whose actions it carries out on
the loop (a step after its predicted time, a batched call of Ranks or of prefill chunks after
the cost model's batch time (`relaygr.cost.batch_ms`), spread by the profile's
`compute_noise`; a peer fetch after its simulated transfer) and whose answers it turns into replies.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from relaygr.behaviours import UserId
from relaygr.cluster import RankerRecord
from relaygr.cost import TransferCost, batch_ms
from relaygr.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from relaygr.room import RoomReport
from services.ranker.core import RankerCore
from services.ranker.core_types import (
    Action,
    Answer,
    CoreSettings,
    Extend,
    FullForward,
    Kept,
    Prefill,
    PrefixRef,
    PreInferAnswer,
    RankAnswer,
    Reload,
    RequestId,
    RunBatch,
    RunStep,
    Score,
    StartFetch,
    call_shape,
)
from services.ranker.digest import ModelVersion, PrefixDigest
from services.ranker.handoff_order import Candidate, Declined
from services.ranker.kv_store import CacheKey, Entry, KVStore, Tier
from services.ranker.outcomes import CacheOutcome, PreInferOutcome
from services.ranker.peers import PeerAsk, PreviousOwners
from services.ranker.plan import Held
from services.ranker.queues import Job
from tooling.sim.events import EventLoop
from tooling.sim.profile import DeviceProfile
from tooling.sim.workload import Visit

MODEL_VERSION = ModelVersion("sim")
# The specs of a scoring call and of a prefix computation (built once: `A | B` makes a new
# union object each time it is evaluated).
_SCORING = (Score, FullForward)
_PREFIX = (Prefill, Extend)


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


def held(kv: SimKV) -> Held:
    return Held(kv.num_behaviours, kv.num_tokens, kv.nbytes, kv.on_device)


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


class SimPrefix:
    """A visit's prefix as the core sees it. Histories only grow, so the long-term length
    identifies a user's prefix, and a shorter one is always a head of a longer one."""

    __slots__ = ("behaviours", "digest", "user_features", "user_id")

    def __init__(self, visit: Visit) -> None:
        self.user_id = UserId(visit.user)
        self.digest = PrefixDigest(str(visit.behaviours))
        self.user_features = visit.user_features
        self.behaviours = visit.behaviours

    def head_digest(self, behaviours: int) -> PrefixDigest:
        return PrefixDigest(str(behaviours))


@dataclass(frozen=True, slots=True)
class SimRank:
    prefix: SimPrefix
    short_term: int
    candidates: int


class Ranker(Protocol):
    """What the fleet needs of a ranker: `SimRanker`, or a real engine behind an adapter."""

    instance_id: str
    alive: bool
    busy_s: float

    @property
    def draining(self) -> bool: ...

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

    def drain(self, landed: Callable[[], None]) -> None:
        """Refuse pre-inference from now on; `landed()` once nothing is in flight."""
        ...

    def handoff_order(self) -> list[Candidate]: ...

    def held_for_peer(self, key: CacheKey) -> Entry[SimKV] | None: ...

    def receive(self, key: CacheKey, kv: SimKV, idle_before: int) -> Tier | Declined: ...

    def use_mark(self) -> int: ...

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


class PeerLookup(Protocol):
    """The fleet as a ranker's peer source: whom to ask for a key, and those peers."""

    def peers(self, key: CacheKey, asking: str, owners: PreviousOwners) -> list[PeerAsk]: ...

    def ranker(self, instance: str) -> "Ranker | None": ...


@dataclass(frozen=True, slots=True)
class SimFetch:
    """Peer fetch on the virtual clock: `lookup` names the peers (asking previous owners while
    `owners` says so); a hit takes `transfer`'s time for its bytes, a miss or a dead peer one
    fixed cost; none past the fallback's deadline."""

    lookup: PeerLookup
    transfer: TransferCost
    owners: PreviousOwners
    max_peers: int = 2


class SimRanker:
    """A ranker instance: PreInfer and Rank answered through callbacks on the loop's clock.

    `kill` ends it at once: every call it has not answered gets UNAVAILABLE, as a client of a
    dead process sees. Work runs one call at a time (a step, or a batch of scoring steps or of
    prefill chunks) on one virtual worker, in the core's order.
    """

    def __init__(
        self,
        instance_id: str,
        loop: EventLoop,
        profile: DeviceProfile,
        settings: CoreSettings,
        dram_ttl_s: float,
        rng: random.Random,
        fetch: SimFetch | None = None,
        record: Callable[[Action], None] | None = None,
    ) -> None:
        """`record`: sees the core's every action (`RankerCore`)."""
        self.instance_id = instance_id
        self.loop = loop
        self.profile = profile
        self.rng = rng
        self._fetch = fetch
        store: KVStore[SimKV] = KVStore(
            profile.device_tier_bytes,
            profile.host_tier_bytes,
            dram_ttl_s,
            loop.clock,
            lambda kv: SimKV(kv.num_behaviours, kv.num_tokens, kv.nbytes, on_device=False),
        )
        self.core: RankerCore[SimKV] = RankerCore(
            store,
            profile.cost,
            settings,
            MODEL_VERSION,
            profile.kv_bytes_per_token,
            held,
            loop.clock,
            peers=None if fetch is None else _Peers(fetch, instance_id),
            record=record,
        )
        self.alive = True
        self.busy_s = 0.0  # virtual seconds the worker computed
        self._replies: dict[RequestId, Callable[[Answer], None]] = {}
        self._running: tuple[Job, ...] = ()  # the call on the virtual worker
        self._landed: Callable[[], None] | None = None

    @property
    def draining(self) -> bool:
        return self.core.draining

    # -- what it publishes ------------------------------------------------------------------

    def room(self) -> RoomReport:
        """What Describe reports of its relay room."""
        stats = self.core.stats()
        usage = stats.tiers[Tier.HBM]
        return RoomReport(
            usage.pinned_bytes, usage.budget_bytes, stats.queued_background_ms,
            stats.queued_rank_ms, stats.kv.relays_consumed, stats.kv.relays_expired_unconsumed,
            stats.relay_wait_p99_ms,
        )  # fmt: skip

    def memory(self) -> MemoryUse:
        """What its tiers hold now."""
        tiers = self.core.stats().tiers
        device, host = tiers[Tier.HBM], tiers[Tier.DRAM]
        return MemoryUse(device.used_bytes, device.pinned_bytes, host.used_bytes)

    # -- requests ---------------------------------------------------------------------------

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
        rid, actions = self.core.pre_infer(SimPrefix(visit), window_s, deadline, rank_in_s)
        self._replies[rid] = lambda a: reply(_pre_infer_reply(a))
        self._apply(actions)

    def rank(
        self, visit: Visit, deadline: float | None, reply: Callable[[RankReply], None]
    ) -> None:
        if not self.alive:
            reply(RankReply(Status.UNAVAILABLE))
            return
        request = SimRank(SimPrefix(visit), visit.short_term, visit.candidates)
        rid, actions = self.core.rank(request, deadline)
        self._replies[rid] = lambda a: reply(_rank_reply(a))
        self._apply(actions)

    # -- lifecycle --------------------------------------------------------------------------

    def drain(self, landed: Callable[[], None]) -> None:
        self._landed = landed
        self._apply(self.core.drain())

    def handoff_order(self) -> list[Candidate]:
        return self.core.handoff_order()

    def held_for_peer(self, key: CacheKey) -> Entry[SimKV] | None:
        return self.core.held_for_peer(key) if self.alive else None

    def receive(self, key: CacheKey, kv: SimKV, idle_before: int) -> Tier | Declined:
        return self.core.receive(key, kv, None, idle_before)

    def use_mark(self) -> int:
        return self.core.use_mark()

    def kill(self) -> None:
        """The process dies: nothing it held survives, every unanswered call fails."""
        self.alive = False
        replies, self._replies = self._replies, {}
        for reply in replies.values():
            reply(Answer(RequestId(0), error=Unavailable("ranker is gone")))
        self._running = ()

    # -- actions ----------------------------------------------------------------------------

    def _apply(self, actions: list[Action]) -> None:
        if not self.alive:
            return
        for action in actions:
            if isinstance(action, Answer):
                reply = self._replies.pop(action.request, None)
                if reply is not None:
                    reply(action)
            elif isinstance(action, RunStep):
                self._run((action.job,))
            elif isinstance(action, RunBatch):
                self._run(action.jobs)
            elif isinstance(action, StartFetch):
                self._start_fetch(action)
        if not self._running:
            free = self.core.worker_free()
            if free:
                self._apply(free)
        if self._landed is not None and not self.core.inflight():
            landed, self._landed = self._landed, None
            landed()

    def _run(self, jobs: tuple[Job, ...]) -> None:
        self._running = jobs
        seconds = self._call_ms(jobs) / 1e3
        noise = self.profile.compute_noise
        if noise:
            seconds *= max(0.0, self.rng.gauss(1.0, noise))
        self.busy_s += seconds
        self.loop.after(seconds, self._stepped, jobs, seconds)

    def _call_ms(self, jobs: tuple[Job, ...]) -> float:
        """A call's time: a scoring call's (one Rank's, or a batch's) or a batch of prefill
        chunks' from the cost model's batch term (each step's single call, less the per-call
        saving of every step after the first); any other step's, as the core predicted it."""
        if len(jobs) == 1 and not isinstance(jobs[0].spec, _SCORING):
            return jobs[0].next_step_ms
        shapes = [call_shape(job.spec, held, job.steps_run) for job in jobs]
        return batch_ms(self.profile.cost, shapes)

    def _stepped(self, jobs: tuple[Job, ...], seconds: float) -> None:
        if self._running is not jobs:
            return  # killed meanwhile
        self._running = ()
        actions: list[Action] = []
        for job in jobs:
            actions += self.core.step_done(job, self._product(job), seconds)
        self._apply(actions)

    def _product(self, job: Job) -> SimKV | Kept[SimKV] | None:
        """What a step leaves: a prefix job its prefix's size (steps compute nothing), a scoring
        job nothing, a full inference that keeps its prefix that prefix (`Kept`)."""
        spec = job.spec
        if isinstance(spec, _PREFIX):
            return self._sized(spec.prefix)
        if isinstance(spec, FullForward) and spec.keep:
            return Kept(None, self._sized(spec.request.prefix))
        return _on_device(spec.host) if isinstance(spec, Reload) else None

    def _sized(self, prefix: PrefixRef) -> SimKV:
        tokens = prefix.user_features + prefix.behaviours
        return SimKV(prefix.behaviours, tokens, tokens * self.profile.kv_bytes_per_token)

    # -- peer fetch -------------------------------------------------------------------------

    def _start_fetch(self, action: StartFetch) -> None:
        self._try_fetch(action, 0)

    def _try_fetch(self, action: StartFetch, index: int) -> None:
        """Ask `action.peers[index]`; on a miss the next one; none left: computed instead."""
        fetch = self._fetch
        assert fetch is not None
        key = action.key
        if index >= len(action.peers):
            self._apply(self.core.fetch_done(key, None))
            return
        deadline = self.core.fetch_deadline(key)
        left = None if deadline is None else deadline - self.loop.now
        ask: PeerAsk = action.peers[index]
        peer = fetch.lookup.ranker(ask.instance_id)
        entry = None if peer is None else peer.held_for_peer(key)
        ok = entry is not None and entry.nbytes == action.nbytes
        seconds = fetch.transfer.ms(action.nbytes if ok else 0) / 1e3
        if left is not None and seconds > left:  # timed out at the deadline
            self.loop.after(max(left, 0.0), self._fetched, action, ask, None, len(action.peers))
            return
        kv = None
        if ok and entry is not None:
            kv = _on_device(entry.kv)
        self.loop.after(seconds, self._fetched, action, ask, kv, index + 1)

    def _fetched(self, action: StartFetch, ask: PeerAsk, kv: SimKV | None, next_index: int) -> None:
        if not self.alive:
            return
        if ask.previous_owner and self._fetch is not None:
            self._fetch.owners.answered(kv is not None)
        if kv is not None:
            self._apply(self.core.fetch_done(action.key, kv))
            return
        self._try_fetch(action, next_index)


class _Peers:
    """A `core.PeerPlanner` over the fleet."""

    def __init__(self, fetch: SimFetch, instance_id: str) -> None:
        self._fetch = fetch
        self._self = instance_id

    def peers(self, key: CacheKey) -> list[Any]:
        fetch = self._fetch
        return fetch.lookup.peers(key, self._self, fetch.owners)[: fetch.max_peers]

    def transfer_ms(self, nbytes: int) -> float:
        return self._fetch.transfer.ms(nbytes)


def _on_device(kv: SimKV) -> SimKV:
    return SimKV(kv.num_behaviours, kv.num_tokens, kv.nbytes)


def _pre_infer_reply(answer: Answer) -> PreInferReply:
    if answer.error is not None:
        return PreInferReply(status_of(answer.error))
    result = answer.result
    assert isinstance(result, PreInferAnswer)
    return PreInferReply(Status.OK, result.outcome, result.nbytes)


def _rank_reply(answer: Answer) -> RankReply:
    if answer.error is not None:
        return RankReply(status_of(answer.error))
    result = answer.result
    assert isinstance(result, RankAnswer)
    return RankReply(Status.OK, result.outcome, result.computed_tokens, result.relayed)
