"""Sequence-aware admission: relay only at-risk requests, where there is room and time to prefill.

Pure policy: no I/O, time passed in as `now` (seconds, any monotonic origin). The service feeds
it retrieval events with the user's fallback order, dispatch outcomes and rankers' observed room
(`relaygr.room`, the view the router keeps too).
"""

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from relaygr.cluster import Directory, RankerRecord
from relaygr.placement import route_rank
from relaygr.room import Relay, RelayRoom
from relaygr.versions import VersionIndex
from services.trigger.config import Mode, TriggerConfig
from services.trigger.demand import RelayDemand

# How many relay ends `TriggerConfig.no_show_prior` weighs as: the prior decides until about
# this many relays have ended on the rankers, the measured share after.
PRIOR_RELAYS = 20.0


class Reason(enum.StrEnum):
    """Why an event was or was not admitted; the names match relaygr.v1.AdmissionReason."""

    ADMITTED = "admitted"  # at risk, relayed
    NOT_AT_RISK = "not_at_risk"
    FOOTPRINT_LIMIT = "footprint_limit"  # larger than every relay budget in the fallback order
    LOAD_LIMIT = "load_limit"  # where there is room, queued prefill would delay the Rank
    ALREADY_CACHED = "already_cached"
    IN_FLIGHT = "in_flight"
    RELAY_DISABLED = "relay_disabled"
    NO_RANKER = "no_ranker"
    NO_ROOM = "no_room"  # no ranker in the fallback order has room now
    SPARE = "spare"  # not at risk, relayed into the owner's spare room (`relay_spare_share`)


ADMITTING = frozenset({Reason.ADMITTED, Reason.SPARE})


def relays_admitted(reasons: Mapping[str, int]) -> int:
    """How many decisions of a count by reason (value) dispatched a relay."""
    return sum(reasons.get(reason.value, 0) for reason in ADMITTING)


class Settled(enum.StrEnum):
    """How a dispatched relay ended, as `AdmissionPolicy.settle` booked it."""

    RELAYED = "relayed"  # resident where the trigger asked (or wherever the router chose)
    RELAYED_ELSEWHERE = "relayed_elsewhere"  # resident, but not on the ranker asked for
    REFUSED = "refused"  # no ranker had room for it
    FAILED = "failed"  # lost for another reason (down, deadline, dropped)


@dataclass(frozen=True, slots=True)
class Event:
    """A retrieval event as the policy sees it. `digest` returns the prefix's identity (the
    service's cheap fingerprint); it is called only for events that may be relayed.
    `model_version` is the version chosen for the user (`relaygr.versions.choose_version`): the
    order the event comes with holds only its rankers, and its relay is booked under it."""

    user_id: str
    prefix_tokens: int  # user features + long-term behaviours
    short_term: int  # expected short-term behaviours at ranking time
    candidates: int  # expected candidates
    digest: Callable[[], str]
    model_version: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    reason: Reason
    predicted_full_ms: float = 0.0  # full inference of the whole expected request
    target: str = ""  # the ranker the relay is expected to land on (refused: the user's owner)
    kv_bytes: int = 0  # what the relay would pin there
    prefill_ms: float = 0.0  # what prefilling the prefix costs there
    digest: str = ""  # the prefix's identity, when it was computed
    model_version: str = ""  # the version it was judged for (the event's)
    relay_window_ms: int = 0  # admitted: the pin its PreInfer asks for (`relay_window_s`)

    @property
    def admitted(self) -> bool:
        return self.reason in ADMITTING


class AdmissionPolicy:
    """Decides which retrieval events to relay, and keeps the books that decision needs.

    An event comes with the user's fallback order: the rankers its PreInfer would try, in the
    order the router tries them (`relaygr.placement.route_rank` with the directory). Checks, in
    order (the first that fails is the reason): mode `off` -> RELAY_DISABLED; an empty order ->
    NO_RANKER; (sequence-aware) the ranking latency predicted without a relay on the owner (the
    first ranker, where the Rank lands) within slo_ms - margin_ms, that latency being the
    owner's last reported queued rank work (`RelayRoom.queued_rank_ms`, cost-model time) plus
    the full inference its cost model predicts, is not at risk: it is relayed only to the owner
    and only while the owner has room and time to spare (`relay_spare_share`; a relay shortens
    its Rank whether or not it is at risk, and one not at risk takes only what nothing at risk
    needs now), else NOT_AT_RISK; the same prefix already relayed ->
    IN_FLIGHT or ALREADY_CACHED. Then (sequence-aware) the relay goes to the first ranker of the
    order where its KV bytes fit `relay_budget_share` of the relay budget beside this trigger's
    relays in flight there (`_fits`), that has not refused a relay for room since it last
    reported, where it is not priced out (below), and where its prefill starts before its Rank
    is expected (expected_gap_ms) behind the background prefill that will run ahead of it there
    (`background_ahead_ms`: the no-shows' share of the ranker's reported and this trigger's
    unreported prefill); none -> LOAD_LIMIT if the relay had room somewhere, else NO_ROOM if it
    fits some ranker's budget at all, else FOOTPRINT_LIMIT. Mode `all` relays
    every event that is not a duplicate to the owner. An admitted relay is booked at once on its
    target.

    Value-ordered footprint (sequence-aware): when the relay room binds, the relays kept are
    those that save the most SLO violations per byte, not the first to arrive. A relay at risk
    saves one violation if its Rank comes (which the trigger cannot tell apart: filtered and
    abandoned requests look the same at retrieval), so its value per byte is 1 / its KV bytes,
    and the smallest relays are worth the most. The trigger keeps the at-risk relays it is asked
    for by size (`RelayDemand`, rates in size classes of 2^(1/4)) and prices a byte of room by
    them: a relay is refused (NO_ROOM) when the relays of smaller size classes alone, each
    holding its bytes as long as a relay is held (`hold_s`: until its Rank, the expected gap,
    or its window for the no-show share), would fill the relay room of the rankers in the order
    (`relay_budget_share` of each budget). Where the room does not bind, nothing is priced out
    and a relay is admitted wherever it fits, into an empty room whatever its size; where it
    binds, a long prefix cannot take the room that shorter ones, arriving before or after it,
    would each save a violation with. Relays within a size class are first come, first served.
    A relay not at risk is ordered the other way (`_outvalued`): it saves no violation, only
    compute off its Rank's path, which per byte grows with the prefix, so where the room binds
    it goes only when the longer prefixes asked for (every retrieval judged, `offered`) would
    leave room for it.
    Relays are booked per (user, model version, prefix): a prefix relayed for one version is
    neither cached nor in flight for another.
    """

    def __init__(self, cfg: TriggerConfig) -> None:
        self.cfg = cfg
        self.room = RelayRoom(cfg.relay_window_s, cfg.refusal_cooldown_ms / 1e3)
        self.demand = RelayDemand()  # at-risk relays: what prices the room for relays at risk
        self.offered = RelayDemand()  # every retrieval judged: what prices it for spare ones

    def reconfigure(self, cfg: TriggerConfig) -> None:
        self.cfg = cfg
        self.room.window_s = cfg.relay_window_s
        self.room.refusal_s = cfg.refusal_cooldown_ms / 1e3

    def decide(self, event: Event, order: Sequence[RankerRecord], now: float) -> Decision:
        """Decide on `event`, whose PreInfer would try the rankers of `order` in turn (all of
        them serving the event's model version)."""
        decision = self._decide(event, order, now)
        if event.model_version:
            return dataclasses.replace(decision, model_version=event.model_version)
        return decision

    def _decide(self, event: Event, order: Sequence[RankerRecord], now: float) -> Decision:
        cfg = self.cfg
        if cfg.mode is Mode.OFF:
            return Decision(Reason.RELAY_DISABLED)
        if not order:
            return Decision(Reason.NO_RANKER)
        owner = order[0]
        history = event.prefix_tokens + event.short_term
        predicted = owner.cost_model().full_ms(history, event.candidates)
        aware = cfg.mode is Mode.SEQUENCE_AWARE
        waits = self.room.queued_rank_ms(owner.instance_id, now)
        at_risk = waits + predicted > cfg.slo_ms - cfg.margin_ms
        nbytes = event.prefix_tokens * owner.kv_bytes_per_token  # on the owner, where it lands
        if aware:
            self.offered.add(nbytes, now)
        if aware and not at_risk and not self._spare(event, order, now):
            return Decision(Reason.NOT_AT_RISK, predicted, owner.instance_id)
        digest = event.digest()
        key = (event.user_id, event.model_version, digest)
        decided = self._decision(event, owner, predicted, digest)
        relay = self.room.live(key, now)
        if relay is not None:
            reason = Reason.IN_FLIGHT if relay.settled_at is None else Reason.ALREADY_CACHED
            return dataclasses.replace(decided, reason=reason)
        if aware:
            if at_risk:
                self.demand.add(nbytes, now)
            priced_out = self._priced_out(event, order, now)
            targets = order[:1] if not at_risk else order
            placed = self._place(event, targets, predicted, digest, priced_out, now)
            if not placed.admitted:
                reason = placed.reason if at_risk else Reason.NOT_AT_RISK
                return dataclasses.replace(decided, reason=reason)
            decided = placed if at_risk else dataclasses.replace(placed, reason=Reason.SPARE)
        window_s = self.relay_window_s(decided.target, now)
        decided = dataclasses.replace(decided, relay_window_ms=round(window_s * 1e3))
        expires = now + cfg.relay_window_s  # in flight: until its dispatch deadline at most
        due = now + cfg.expected_gap_ms / 1e3
        booked = Relay(
            decided.target, decided.kv_bytes, expires, decided.prefill_ms, admitted_at=now,
            due_at=due, window_s=window_s,
        )  # fmt: skip
        self.room.start(key, booked)
        return decided

    def relay_window_s(self, instance: str, now: float) -> float:
        """The pin a relay to `instance` asks for: `relay_window_wait_factor` times the
        99th-percentile wait of a relay for its Rank that the instance last reported (or, where
        it has too few timed, another ranker: `RelayRoom.wait_tail_ms`), at most
        `relay_window_ms`; `relay_window_ms` when the factor is 0 or no ranker reported a wait
        lately. A window that covers the gap's tail keeps the relays whose Rank comes; one past
        it only lets no-shows hold room (docs/sizing.md, "The relay window")."""
        cfg = self.cfg
        tail_ms = self.room.wait_tail_ms(instance, now) if cfg.relay_window_wait_factor else 0.0
        if tail_ms <= 0:
            return cfg.relay_window_s
        return min(cfg.relay_window_s, max(cfg.relay_window_wait_factor * tail_ms / 1e3, 1e-3))

    def _place(
        self,
        event: Event,
        order: Sequence[RankerRecord],
        predicted: float,
        digest: str,
        priced_out: bool,
        now: float,
    ) -> Decision:
        """The first ranker of `order` with room and time for the relay (ADMITTED there), or
        why there is none. `priced_out`: the room it fits is worth more to smaller relays."""
        cfg = self.cfg
        # The Rank arrives after the gap and then either waits for its prefix or computes it in
        # full, whichever the ranker predicts is sooner: a relay whose prefill starts before
        # then saves its Rank the prefill already done; one that would start later saves
        # nothing and only adds background work.
        start_by_ms = cfg.expected_gap_ms
        reason = Reason.FOOTPRINT_LIMIT
        for ranker in order:
            nbytes = event.prefix_tokens * ranker.kv_bytes_per_token
            if nbytes > self.room.budget(ranker) * cfg.relay_budget_share:
                continue  # would never fit there
            if priced_out or not self._fits(ranker, nbytes, now):
                reason = Reason.LOAD_LIMIT if reason is Reason.LOAD_LIMIT else Reason.NO_ROOM
                continue
            reason = Reason.LOAD_LIMIT
            decided = self._decision(event, ranker, predicted, digest)
            if self.background_ahead_ms(ranker.instance_id, now) < start_by_ms:
                return decided
        return Decision(reason)

    def no_show_share(self) -> float:
        """The share of relays whose Rank never comes, as the rankers' relay ends show it
        (`RelayRoom.ends`), blended with `no_show_prior` worth `PRIOR_RELAYS` ends."""
        return self.room.ends.no_show_share(self.cfg.no_show_prior, PRIOR_RELAYS)

    def background_ahead_ms(self, instance: str, now: float) -> float:
        """Background prefill that runs on `instance` before a relay sent there now starts:
        the no-show share (`no_show_share`) of what is queued there. Background work runs
        earliest due first, so what is queued ahead of the relay is due before it, and the Rank
        of each such relay that is ranked comes first and promotes its prefill out of the
        background queue (rank work a miss would have brought anyway); a no-show's prefill
        stays and runs. With no no-shows, a relay never waits behind another's background
        prefill, and one whose queue looks late is taken over by its own Rank
        (`RankerCore._take_over`): at worst a miss computed in line."""
        return self.room.queued_ms(instance, now) * self.no_show_share()

    def _spare(self, event: Event, order: Sequence[RankerRecord], now: float) -> bool:
        """Has the owner (`order[0]`) room and time to spare for this relay not at risk: its
        relay room less than `relay_spare_share` full (0 spares nothing), the background prefill
        ahead of it (`background_ahead_ms`) under half the expected gap, and the relay not
        outvalued (`_outvalued`)? Such a relay still shortens its Rank (the prefix is ready, not
        computed in line), and takes nothing a relay at risk would need now; past any mark, only
        relays at risk go."""
        cfg = self.cfg
        owner = order[0]
        budget = self.room.budget(owner) * cfg.relay_budget_share
        held = self.room.held(owner.instance_id, now, 1 - self.no_show_share())
        ahead = self.background_ahead_ms(owner.instance_id, now)
        spare = held < budget * cfg.relay_spare_share and ahead < cfg.expected_gap_ms / 2
        return spare and not self._outvalued(event, order, now)

    def _outvalued(self, event: Event, order: Sequence[RankerRecord], now: float) -> bool:
        """Would the retrievals of larger size classes than this one (`offered`: every one
        judged, at risk or not), each held `hold_s`, fill the relay room of `order`? A relay
        not at risk saves its Rank the prefill, time off the Rank's path and off the queue the
        Ranks behind it wait in, and that saving per byte of room grows with the prefix
        (attention is quadratic in it, its bytes linear): where the room binds, the longest
        prefixes make the best use of it, and a short one would take the room a long one
        arriving during its hold is then refused (and computed in full at its Rank)."""
        return self._fills_room(self.offered.held_above, event, order, now)

    def hold_s(self, window_s: float) -> float:
        """How long a relay holds its bytes, expected: until its Rank (the expected gap), or
        for its window (`window_s`) when its Rank never comes (the no-show share)."""
        share = self.no_show_share()
        return (1 - share) * self.cfg.expected_gap_ms / 1e3 + share * window_s

    def _priced_out(self, event: Event, order: Sequence[RankerRecord], now: float) -> bool:
        """Would the at-risk relays of smaller size classes than this one, each held `hold_s`,
        fill the relay room of `order` (`relay_budget_share` of each ranker's budget)?"""
        return self._fills_room(self.demand.held_below, event, order, now)

    def _fills_room(
        self,
        held: Callable[[int, float, float], float],
        event: Event,
        order: Sequence[RankerRecord],
        now: float,
    ) -> bool:
        """Do the relays `held` counts for this event's size (a `RelayDemand`'s `held_below`
        or `held_above`), each held `hold_s`, fill the relay room of `order`?

        The rankers' budgets are summed only until they exceed what is held: where the room
        does not bind, a few rankers of the order answer it, not all of them (over 1,000
        rankers, summing every budget made a decision 190 us against 28: docs/sizing.md)."""
        nbytes = event.prefix_tokens * order[0].kv_bytes_per_token
        need = held(nbytes, self.hold_s(self.relay_window_s(order[0].instance_id, now)), now)
        share = self.cfg.relay_budget_share
        budget = 0
        for record in order:
            budget += self.room.budget(record)
            if budget * share > need:  # the rest only adds room
                return False
        return need >= budget * share

    def _fits(self, ranker: RankerRecord, nbytes: int, now: float) -> bool:
        """Does the relay fit `relay_budget_share` of the ranker's relay budget beside this
        trigger's relays in flight there (`RelayRoom.in_flight`), with no refusal for room
        since the ranker last reported?

        The ranker has the final word on what is pinned: it pins a relay only while its pinned
        bytes leave room, and refuses it RESOURCE_EXHAUSTED otherwise (the router tries the
        next ranker; the refusal marks the ranker full here until it reports again). What its
        check cannot see is what is on its way: the relays sent and not yet pinned, which this
        trigger books so that a burst stops at the room. The trigger does not judge by the
        ranker's reported pinned bytes as well: a report up to a Describe period old, with the
        relays settled since counted until a later one, saw rooms full that the rankers still
        had room in, and the relays it refused were the long ones that set the P99
        (docs/benchmarks.md, "The trigger and the ranker's room")."""
        if self.room.refused(ranker.instance_id, now):
            return False
        in_flight = self.room.in_flight(ranker.instance_id, now)
        return in_flight + nbytes <= self.room.budget(ranker) * self.cfg.relay_budget_share

    @staticmethod
    def _decision(event: Event, ranker: RankerRecord, predicted: float, digest: str) -> Decision:
        """ADMITTED on `ranker`, with what the relay would pin and cost there."""
        nbytes = event.prefix_tokens * ranker.kv_bytes_per_token
        prefill_ms = ranker.cost_model().prefill_ms(event.prefix_tokens)
        return Decision(Reason.ADMITTED, predicted, ranker.instance_id, nbytes, prefill_ms, digest)

    def settled(
        self,
        user_id: str,
        digest: str,
        instance: str,
        nbytes: int,
        now: float,
        model_version: str = "",
    ) -> None:
        """The relay's PreInfer came back from `instance`, which pinned `nbytes`."""
        self.room.settle((user_id, model_version, digest), instance, nbytes, now)

    def landed(
        self,
        decision: Decision,
        user_id: str,
        instance: str,
        nbytes: int,
        preferred: str,
        now: float,
    ) -> bool:
        """The relay's PreInfer, sent to land on `preferred` ("": wherever the router chose),
        came back from `instance`, which pinned `nbytes`. True when it landed elsewhere: the
        preferred ranker refused it (or was down), so it is full until observed otherwise."""
        self.settled(user_id, decision.digest, instance, nbytes, now, decision.model_version)
        if preferred and instance != preferred:
            self.room.refuse(preferred, now)
            return True
        return False

    def preferred(self, decision: Decision) -> str:
        """The ranker an admitted relay asks the router for: sequence-aware, the one it found
        room on; otherwise none ("": the router's own order)."""
        return decision.target if self.cfg.mode is Mode.SEQUENCE_AWARE else ""

    def dropped(self, decision: Decision, user_id: str) -> Decision:
        """An admitted relay the dispatcher could not queue: its booking is freed, and the
        caller is told LOAD_LIMIT instead."""
        self.failed(user_id, decision.digest, decision.model_version)
        return Decision(
            Reason.LOAD_LIMIT, decision.predicted_full_ms, decision.target,
            model_version=decision.model_version,
        )  # fmt: skip

    def settle(
        self,
        decision: Decision,
        user_id: str,
        preferred: str,
        landed: tuple[str, int] | None,
        refused_for_room: bool,
        now: float,
    ) -> Settled:
        """Book how a dispatched relay (sent asking for `preferred`) ended: `landed` on
        (instance, bytes pinned), else refused by every ranker for want of room, else failed.
        The one place the service's dispatcher and the simulator settle a relay."""
        if landed is not None:
            instance, nbytes = landed
            elsewhere = self.landed(decision, user_id, instance, nbytes, preferred, now)
            return Settled.RELAYED_ELSEWHERE if elsewhere else Settled.RELAYED
        if refused_for_room:
            self.refused(decision, user_id, now)
            return Settled.REFUSED
        self.failed(user_id, decision.digest, decision.model_version)
        return Settled.FAILED

    def failed(self, user_id: str, digest: str, model_version: str = "") -> None:
        """The relay was not sent, or failed for a reason other than room."""
        self.room.fail((user_id, model_version, digest))

    def refused(self, decision: Decision, user_id: str, now: float) -> None:
        """The target refused the relay for want of room: full until observed otherwise (or
        for refusal_cooldown_ms)."""
        self.room.fail((user_id, decision.model_version, decision.digest))
        self.room.refuse(decision.target, now)

    def sweep(self, now: float, instances: Mapping[str, object]) -> None:
        """Forget expired relays and everything about rankers no longer in `instances`."""
        self.room.sweep(now, instances)


def fallback_order(
    user_id: str, model_version: str, index: VersionIndex, directory: Directory
) -> list[RankerRecord]:
    """The rankers of `model_version` (as `index` splits the view) the router would try for the
    user's PreInfer, in its order: the directory's live entry for the user under that version,
    then the user's rendezvous order over those rankers."""
    recorded = directory.lookup(user_id, model_version)
    placed = {} if recorded is None else {user_id: recorded}
    mine = index.serving(model_version)
    return [mine[i] for i in route_rank(user_id, index.serving_ids(model_version), placed)]
