"""A fleet on the virtual clock: one trigger, one router and N rankers, wired as the services are.

The trigger is the real `AdmissionPolicy` (its relay room and books), fed the fallback order the
service computes and the rankers' Describe answers every `observe_interval_ms`; its dispatcher's
bounds (queue, concurrency) are kept. The router is the real `Forwarder`: `route` places and
orders, its counting and learning run on each answer, `book` settles, with the membership and
directory in a `MemoryCluster` on the same clock. Rankers are `SimRanker`s. What is not
simulated: the etcd round trips (a directory write is visible at once) and the network beyond a
fixed per-request overhead (the profile's `request_overhead_ms`, half each way).
"""

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from relaygr.cluster import MemoryCluster, RankerRecord
from relaygr.room import RelayRoom
from relaygr.versions import VersionIndexer, choose_version
from services.ranker.config import RankerConfig
from services.ranker.handoff import HandoffSettings, plan
from services.ranker.handoff_order import Declined
from services.ranker.kv_store import CacheKey
from services.ranker.peers import PeerAsk, PreviousOwners, fetch_peers
from services.router.attempts import Attempts, Next
from services.router.config import RouterConfig
from services.router.forward import Forwarder, RelayHint
from services.router.routes import CallFailed, Method, Refused, Route, Served
from services.router.routes import Status as CallStatus
from services.trigger.config import TriggerConfig
from services.trigger.policy import AdmissionPolicy, Decision, Event, Settled, fallback_order
from tooling.local.drive import NO_RANK, OK, RequestRecord
from tooling.sim.events import EventLoop, collector_paused
from tooling.sim.profile import DeviceProfile
from tooling.sim.ranker import (
    MODEL_VERSION,
    MemoryUse,
    PreInferReply,
    Ranker,
    RankReply,
    SimFetch,
    SimRanker,
    Status,
    ranker_record,
)
from tooling.sim.workload import Visit


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """The services' own configurations, as their processes would be given them."""

    rankers: int = 2
    # (Transport security means nothing here: the configurations say plaintext to be valid.)
    ranker: RankerConfig = field(default_factory=lambda: RankerConfig(plaintext=True))
    router: RouterConfig = field(default_factory=lambda: RouterConfig(plaintext=True))
    trigger: TriggerConfig = field(default_factory=lambda: TriggerConfig(plaintext=True))
    gap_s: float = 1.0  # retrieval to Rank
    # Trigger replicas: each sends up to dispatch_concurrency PreInfers at once. They share one
    # admission policy's books here (optimistic: real replicas each keep their own).
    triggers: int = 1
    rank_timeout_s: float = 30.0  # the ranking caller's deadline
    # A bound, not a system (bench/sim_bound.py): the trigger is never shown a retrieval whose
    # Rank will not come, as if it knew the no-shows at retrieval time.
    no_show_oracle: bool = False

    @classmethod
    def serving(
        cls, rankers: int, slo_ms: float, margin_ms: float, gap_ms: float, triggers: int = 1
    ) -> "FleetSettings":
        """The services' defaults but for the SLO, the at-risk margin and the gap."""
        trigger = TriggerConfig(
            plaintext=True, slo_ms=slo_ms, margin_ms=margin_ms, expected_gap_ms=gap_ms
        )
        return cls(rankers=rankers, trigger=trigger, gap_s=gap_ms / 1e3, triggers=triggers)

    def with_relay_window(self, window_ms: int) -> "FleetSettings":
        """These settings with every relay pinned `window_ms` awaiting its Rank: the window the
        trigger asks for and the one the router and the rankers default to."""
        return replace(
            self,
            trigger=replace(self.trigger, relay_window_ms=window_ms),
            router=replace(self.router, relay_window_ms=window_ms),
            ranker=replace(self.ranker, relay_window_ms=window_ms),
        )


@dataclass(slots=True)
class FleetStats:
    """What the fleet did beyond the per-request records, for sizing."""

    relays_refused: int = 0  # relays no ranker had room for (RESOURCE_EXHAUSTED)
    relays_failed: int = 0  # relays lost otherwise (ranker down, deadline)
    dispatch_dropped: int = 0  # admitted relays the dispatcher queue could not take
    registrations: int = 0  # membership writes (a ranker joining)
    deregistrations: int = 0  # a ranker leaving (drain) or its lease lapsing (kill)
    handed_off: int = 0  # prefixes a draining ranker's successors admitted
    handoff_unsent: int = 0  # planned but past the time budget, or gone since the plan
    handoff_declined: int = 0  # sent, not stored (held, computing, no room)
    # Seconds draining rankers stayed registered (drain to deregistration), all drains summed:
    # the router spills a draining ranker's relays meanwhile, each a directory write.
    draining_s: float = 0.0
    peak_directory_entries: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)  # compute per ranker, seconds
    # Per ranker, the most its tiers held at any observation tick (the trigger's interval).
    peak_memory: dict[str, MemoryUse] = field(default_factory=dict)

    def peak(self) -> MemoryUse:
        """The most any one ranker held, figure by figure."""
        peak = MemoryUse()
        for use in self.peak_memory.values():
            peak = peak.peak(use)
        return peak


MakeRanker = Callable[[str, "Fleet"], Ranker]
ORACLE_NO_SHOW = "oracle_no_show"  # the decision recorded for a retrieval the oracle hid


def sim_ranker(instance: str, fleet: "Fleet") -> SimRanker:
    """A simulated ranker of the fleet's profile and ranker configuration (fetching missed
    prefixes from its peers when `peer_fetch` is on, at the configured transfer cost)."""
    cfg = fleet.settings.ranker
    fetch = None
    if cfg.peer_fetch and cfg.relay_enabled:
        fetch = SimFetch(fleet, cfg.transfer_prior(), cfg.previous_owners())
    return SimRanker(
        instance,
        fleet.loop,
        fleet.profile,
        cfg.core_settings(),
        cfg.dram_ttl_s,
        random.Random(fleet.rng.getrandbits(64)),
        fetch,
    )


def _no_transport(address: str, method: Method) -> Any:
    raise AssertionError("the simulated router calls rankers through the fleet")


@dataclass(slots=True)
class _Relay:
    index: int
    visit: Visit
    decision: Decision
    due_at: float


# One call to a ranker: `call(instance, answered)`; `answered` gets its reply or failure.
Answered = Callable[[bytes | CallFailed], None]
CallRanker = Callable[[str, Answered], None]
Outcome = Served | Refused
Ended = Callable[[Outcome], None]


class _Forwarding:
    """One request down its route: the router's own `Attempts` on the virtual clock.

    `call(instance, answered)` sends one call, `ended` gets the request's end. A hedge's timer
    is re-armed after every event while the attempts say so; only the latest timer counts, and
    a losing call's answer is ignored (`Attempts.answered`). The loop's callbacks hold this
    object; it holds none of them, so a finished request is freed without the cycle collector.
    """

    __slots__ = ("_attempts", "_call", "_ended", "_loop", "_timer")

    def __init__(self, loop: EventLoop, attempts: Attempts, call: CallRanker, ended: Ended) -> None:
        self._loop = loop
        self._attempts = attempts
        self._call = call
        self._ended = ended
        self._timer = 0  # the live hedge timer's generation

    def start(self) -> None:
        self._step(self._attempts.start())

    def _step(self, next_: Next) -> None:
        if not isinstance(next_, list):
            self._ended(next_)
            return
        for c in next_:
            self._call(c.instance, partial(self._answered, c.instance))
        attempts = self._attempts
        if attempts.hedge_armed and attempts.hedge_s is not None:
            self._timer += 1
            self._loop.after(attempts.hedge_s, self._fire, self._timer)

    def _answered(self, instance: str, answer: bytes | CallFailed) -> None:
        self._step(self._attempts.answered(instance, answer))

    def _fire(self, generation: int) -> None:
        if generation == self._timer:
            self._step(self._attempts.hedge())


class Fleet:
    """Trigger, router and rankers on `loop`; `visit` schedules one arrival's retrieval and Rank.

    Every arrival ends with one `RequestRecord` in `records` (by arrival index), as the real
    driver's: the Rank's latency from its intended send time, its status and cache outcome, and
    the trigger's decision.
    """

    def __init__(
        self,
        loop: EventLoop,
        profile: DeviceProfile,
        settings: FleetSettings,
        seed: int,
        make_ranker: MakeRanker | None = None,
    ) -> None:
        """`make_ranker` (None: `SimRanker`s) builds each ranker from its id and the fleet."""
        self.loop = loop
        self.profile = profile
        self.settings = settings
        self.rng = random.Random(seed)
        self.cluster = MemoryCluster(clock=loop.clock)
        self.rankers: dict[str, Ranker] = {}
        self._make_ranker = make_ranker or sim_ranker
        # PreInfers served: arrival index -> (ranker, PreInfer outcome)
        self.relays_served: dict[int, tuple[str, str]] = {}
        self.policy = AdmissionPolicy(settings.trigger)
        self._index = VersionIndexer()
        router = settings.router
        forward = router.forward_settings()
        self.forwarder = Forwarder(
            forward,
            self.cluster,
            self.cluster,
            _no_transport,
            clock=loop.clock,
            draw=self.rng.randrange,
            room=RelayRoom(forward.relay_window_s, forward.refusal_s),
        )
        self.records: dict[int, RequestRecord] = {}
        self.stats = FleetStats()
        self._hop_s = profile.request_overhead_ms / 2e3
        self._waiting: deque[_Relay] = deque()  # the trigger's dispatch queue
        self._sending = 0
        self._made = 0
        self._changed_at = float("-inf")  # the membership last changed
        self._drained_at: dict[str, float] = {}  # rankers draining, since when
        for _ in range(settings.rankers):
            self.add_ranker()
        self._observe_every(settings.trigger.observe_interval_ms / 1e3, self._trigger_observes)
        self._observe_every(router.observe_interval_ms / 1e3, self._router_observes)

    # -- membership -------------------------------------------------------------------------

    def add_ranker(self) -> str:
        index = self._made
        self._made += 1
        instance = f"ranker-{index}"
        self.rankers[instance] = self._make_ranker(instance, self)
        record = ranker_record(instance, index, self.profile)
        self.cluster.join(record, self.settings.ranker.lease_ttl_s)
        self.stats.registrations += 1
        self._changed_at = self.loop.now
        return instance

    def kill(self, instance: str) -> None:
        """The ranker's process dies; its lease lapses `lease_ttl_s` later."""
        self.rankers[instance].kill()
        self.loop.after(self.settings.ranker.lease_ttl_s, self._leave, instance)

    def drain(self, instance: str) -> None:
        """As `RankerServer.drain`: the ranker refuses pre-inference and lands what is in
        flight; hands its most valuable prefixes to their next owners while still registered
        (serving its users meanwhile); then leaves the membership and serves what it has."""
        self._drained_at[instance] = self.loop.now
        self.rankers[instance].drain(lambda: self._hand_off(instance))

    def _hand_off(self, instance: str) -> None:
        """The hand-off: entries in value order, over the shared bandwidth, each stored by its
        receiver when through; what would not be through within the budget is not sent."""
        cfg, sender = self.settings.ranker, self.rankers[instance]
        settings = HandoffSettings.of(cfg)
        if not cfg.handoff or not sender.alive:
            self._leave(instance)
            return
        start, view = self.loop.now, self.cluster.view()
        ordered = sender.handoff_order()
        routes = plan(ordered, view, instance, MODEL_VERSION, settings.max_entries)
        self.stats.handoff_unsent += len(ordered) - sum(len(v) for v in routes.values())
        owner = {c.key: t.instance_id for t, entries in routes.items() for c in entries}
        marks = {t.instance_id: self.rankers[t.instance_id].use_mark() for t in routes}
        free_at, end = start, start + settings.within(cfg.drain_grace_s)
        for c in ordered:
            target = owner.get(c.key)
            if target is None:
                continue
            through = free_at + c.nbytes / settings.bytes_per_s
            if through > end:  # a smaller one may still fit
                self.stats.handoff_unsent += 1
                continue
            free_at = through
            self.loop.at(through, self._deliver, instance, target, c.key, marks[target])
        self.loop.at(free_at, self._leave, instance)

    def _deliver(self, sender: str, target: str, key: CacheKey, mark: int) -> None:
        entry = self.rankers[sender].held_for_peer(key)
        receiver = self.rankers[target]
        if entry is None or not receiver.alive:
            self.stats.handoff_unsent += 1
            return
        admitted = receiver.receive(key, entry.kv, mark)
        if isinstance(admitted, Declined):
            self.stats.handoff_declined += 1
        else:
            self.stats.handed_off += 1

    def _leave(self, instance: str) -> None:
        if instance in self.cluster.view():
            self.cluster.leave(instance)
            self.stats.deregistrations += 1
            if (since := self._drained_at.pop(instance, None)) is not None:
                self.stats.draining_s += self.loop.now - since
            self._changed_at = self.loop.now

    # -- the rankers' peer source (`ranker.PeerLookup`) -------------------------------------

    def peers(self, key: CacheKey, asking: str, owners: PreviousOwners) -> list[PeerAsk]:
        """Whom `asking` asks for `key`, as the service's peer source would."""
        moved = owners.asking(self.loop.now, self._changed_at)
        holder = self.cluster.lookup(key.user_id, key.model_version)
        return fetch_peers(
            key.user_id, key.model_version, self.cluster.view(), asking, holder, moved
        )

    def ranker(self, instance: str) -> Ranker | None:
        ranker = self.rankers.get(instance)
        return ranker if ranker is not None and ranker.alive else None

    def live(self) -> list[str]:
        return list(self.cluster.view())

    # -- observation ------------------------------------------------------------------------

    def _observe_every(self, interval_s: float, observe: Callable[[], None]) -> None:
        if interval_s <= 0:
            return

        def tick() -> None:
            observe()
            self.loop.after(interval_s, tick)

        self.loop.after(interval_s, tick)

    def _describe_into(self, room: RelayRoom) -> None:
        """Every live member's Describe answer, booked on `room` as sent now."""
        now = self.loop.now
        for instance in self.cluster.view():
            ranker = self.rankers[instance]
            if ranker.alive:
                room.observe(instance, ranker.room(), now)

    def _trigger_observes(self) -> None:
        now, view = self.loop.now, self.cluster.view()
        self._describe_into(self.policy.room)
        peaks = self.stats.peak_memory
        for instance, ranker in self.rankers.items():
            if ranker.alive:
                peaks[instance] = peaks.get(instance, MemoryUse()).peak(ranker.memory())
        self.policy.sweep(now, view)
        self.stats.peak_directory_entries = max(
            self.stats.peak_directory_entries, self.cluster.placements()
        )

    def _router_observes(self) -> None:
        room = self.forwarder.room
        assert room is not None
        self._describe_into(room)
        room.sweep(self.loop.now, self.cluster.view())

    # -- one arrival ------------------------------------------------------------------------

    def visit(self, index: int, visit: Visit) -> None:
        """Schedule `visit`'s retrieval at its time and its Rank one gap later (the visit's
        own gap, else the fleet's), if one follows."""
        self.loop.at(visit.at, self._retrieval, index, visit)
        if visit.ranked:
            self.loop.at(visit.at + self._gap_s(visit), self._rank, index, visit)

    def _gap_s(self, visit: Visit) -> float:
        return self.settings.gap_s if visit.gap_s is None else visit.gap_s

    def _retrieval(self, index: int, visit: Visit) -> None:
        now = self.loop.now
        if self.settings.no_show_oracle and not visit.ranked:
            self.records[index] = RequestRecord(
                index, visit.at + self._gap_s(visit), 0.0, NO_RANK, decision_status=OK,
                decision=ORACLE_NO_SHOW,
            )  # fmt: skip
            return
        view = self.cluster.view()
        # One model version here: the trigger's choice, as the service makes it.
        split = self._index(view)
        version = choose_version(visit.user, "", self.forwarder.versions, split.live)
        order = [] if version is None else fallback_order(visit.user, version, split, self.cluster)
        event = Event(
            visit.user,
            visit.prefix_tokens,
            visit.short_term,
            visit.candidates,
            lambda: str(visit.behaviours),
            version or "",
        )
        decision = self.policy.decide(event, order, now)
        self.records[index] = RequestRecord(
            index, visit.at + self._gap_s(visit), 0.0, "" if visit.ranked else NO_RANK,
            decision_status=OK, decision=decision.reason.value, admitted=decision.admitted,
        )  # fmt: skip
        if not decision.admitted:
            return
        cfg = self.settings.trigger
        if len(self._waiting) >= cfg.dispatch_queue * self.settings.triggers:
            self.stats.dispatch_dropped += 1
            dropped = self.policy.dropped(decision, visit.user)
            self.records[index] = replace(
                self.records[index], decision=dropped.reason.value, admitted=False
            )
            return
        self._waiting.append(_Relay(index, visit, decision, now + cfg.expected_gap_ms / 1e3))
        self._dispatch()

    # -- the trigger's dispatcher and the router's PreInfer ---------------------------------

    def _dispatch(self) -> None:
        limit = self.settings.trigger.dispatch_concurrency * self.settings.triggers
        while self._waiting and self._sending < limit:
            self._sending += 1
            relay = self._waiting.popleft()
            self.loop.after(self._hop_s, self._route_pre_infer, relay)

    def _route_pre_infer(self, relay: _Relay) -> None:
        cfg = self.settings.trigger
        hint = RelayHint(self.policy.preferred(relay.decision), relay.visit.prefix_tokens)
        route = self.forwarder.route(
            Method.PRE_INFER, relay.visit.user, hint, relay.decision.model_version
        )
        deadline = self.loop.now + cfg.relay_window_ms / 1e3
        if not isinstance(route, Route):
            self._relay_done(relay, None, False)
            return
        self._try_pre_infer(relay, route, deadline)

    def _try_pre_infer(self, relay: _Relay, route: Route, deadline: float) -> None:
        due_in = max(relay.due_at - self.loop.now, 1e-3)
        window_s = relay.decision.relay_window_ms / 1e3
        served: dict[str, PreInferReply] = {}

        def call(instance: str, answered: Answered) -> None:
            def reply(answer: PreInferReply) -> None:
                if answer.status is Status.OK:
                    served[instance] = answer
                    answered(b"")
                else:
                    answered(CallFailed(CallStatus(answer.status.value), None))

            ranker = self.rankers[instance]
            ranker.pre_infer(relay.visit, window_s, due_in, deadline, reply)

        def ended(outcome: Outcome) -> None:
            if isinstance(outcome, Refused):
                refused = outcome.status is CallStatus.RESOURCE_EXHAUSTED
                self.loop.after(self._hop_s, self._relay_done, relay, None, refused)
                return
            answer = served[outcome.instance]
            assert answer.outcome is not None
            self.relays_served[relay.index] = (outcome.instance, answer.outcome.value)
            self._book(route, outcome)
            landed = (outcome.instance, answer.nbytes)
            self.loop.after(self._hop_s, self._relay_done, relay, landed, False)

        self._forward(route, call, ended)

    def _forward(self, route: Route, call: CallRanker, ended: Ended) -> None:
        """Drive the router's own `Attempts` for `route` on the virtual clock (`_Forwarding`)."""
        _Forwarding(self.loop, self.forwarder.attempts(route), call, ended).start()

    def _book(self, route: Route, served: Served) -> None:
        if self.forwarder.book(route, served):
            placement = self.forwarder.placement(route.user, served.instance, route.model_version)
            self.forwarder.recorded(self.cluster.put(placement, served.instance))

    def _relay_done(self, relay: _Relay, landed: tuple[str, int] | None, refused: bool) -> None:
        """The trigger hears how its PreInfer ended (the dispatcher's `on_outcome`)."""
        self._sending -= 1
        decision = relay.decision
        preferred = self.policy.preferred(decision)
        user, now = relay.visit.user, self.loop.now
        settled = self.policy.settle(decision, user, preferred, landed, refused, now)
        self.stats.relays_refused += settled is Settled.REFUSED
        self.stats.relays_failed += settled is Settled.FAILED
        self._dispatch()

    # -- the router's Rank ------------------------------------------------------------------

    def _rank(self, index: int, visit: Visit) -> None:
        sent = self.loop.now
        route = self.forwarder.route(Method.RANK, visit.user)
        deadline = sent + self.settings.rank_timeout_s
        if not isinstance(route, Route) or not route.order:
            self._ranked(index, sent, RankReply(Status.UNAVAILABLE), "")
            return
        self.loop.after(self._hop_s, self._try_rank, index, visit, route, sent, deadline)

    def _try_rank(
        self, index: int, visit: Visit, route: Route, sent: float, deadline: float
    ) -> None:
        replies: dict[str, RankReply] = {}

        def call(instance: str, answered: Answered) -> None:
            def reply(answer: RankReply) -> None:
                replies[instance] = answer
                if answer.status is Status.OK:
                    answered(b"")
                else:
                    answered(CallFailed(CallStatus(answer.status.value), None))

            self.rankers[instance].rank(visit, deadline, reply)

        def ended(outcome: Outcome) -> None:
            if isinstance(outcome, Served):
                reply, instance = replies[outcome.instance], outcome.instance
            else:
                reply, instance = RankReply(Status(outcome.status.value)), ""
            self.loop.after(self._hop_s, self._ranked, index, sent, reply, instance)

        self._forward(route, call, ended)

    def _ranked(self, index: int, sent: float, reply: RankReply, instance: str) -> None:
        decided = self.records.get(index)
        outcome = "" if reply.outcome is None else reply.outcome.value
        record = RequestRecord(
            index, sent, self.loop.now - sent, reply.status.value, outcome, instance,
            relayed=reply.relayed,
        )  # fmt: skip
        if decided is not None:
            record = RequestRecord(
                index, sent, record.latency_s, record.status, outcome, instance,
                relayed=reply.relayed, decision_status=decided.decision_status,
                decision=decided.decision, admitted=decided.admitted,
            )  # fmt: skip
        self.records[index] = record

    # -- results ----------------------------------------------------------------------------

    def finished(self) -> list[RequestRecord]:
        """Every arrival's record, in arrival order (call once the loop has run out)."""
        for name, ranker in self.rankers.items():
            self.stats.busy_s[name] = ranker.busy_s
        return [self.records[i] for i in sorted(self.records)]

    def ranker_records(self) -> Sequence[RankerRecord]:
        return list(self.cluster.view().values())


def run_visits(
    profile: DeviceProfile,
    settings: FleetSettings,
    visits: Sequence[Visit],
    seed: int,
    make_ranker: MakeRanker | None = None,
) -> tuple[list[RequestRecord], Fleet]:
    """Run `visits` through a fresh fleet to the end; the records in arrival order."""
    with collector_paused():
        loop = EventLoop()
        fleet = Fleet(loop, profile, settings, seed, make_ranker)
        for index, visit in enumerate(visits):
            fleet.visit(index, visit)
        end = (visits[-1].at if visits else 0.0) + settings.gap_s + settings.rank_timeout_s + 1.0
        loop.run(until=end)
        return fleet.finished(), fleet
