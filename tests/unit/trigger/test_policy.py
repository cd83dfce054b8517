"""Trigger admission: reasons in order, room over the fallback order, queued prefill, live cfg."""

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from relaygr.cluster import MemoryCluster, PlacementRecord, RankerRecord
from relaygr.config import override_config
from relaygr.errors import ConfigError
from relaygr.placement import ranking
from relaygr.room import RoomReport
from relaygr.versions import VersionIndex
from services.trigger.config import LIVE_FIELDS, Mode, TriggerConfig
from services.trigger.policy import AdmissionPolicy, Decision, Event, Reason, fallback_order

# A cost model of powers of two, so every prediction below is exact in binary:
#   full(t, c) = 1 + t/8 + c/8 + t^2/2048 + c*t/256      prefill(t) = 1 + t/8 + t^2/2048
# With the default event (96 prefix + 32 short-term = 128 history tokens):
#   full(128, 32) = 1 + 16 + 4 + 8 + 16 = 45.0 = slo_ms - margin_ms (50 - 5): not at risk
#   full(128, 33) = 45.625: at risk;  prefill(96) = 1 + 12 + 4.5 = 17.5
PREFIX, SHORT_TERM = 96, 32
SAFE, AT_RISK = 32, 33  # candidates
PREDICTED = {SAFE: 45.0, AT_RISK: 45.625}
PREFILL_MS = 17.5
KV_BYTES_PER_TOKEN = 1000
NBYTES = PREFIX * KV_BYTES_PER_TOKEN  # 96,000
X = "ranker-0"
WINDOW_MS = 2000  # the default relay window: what an admitted relay asks for here
NOW = 1.0
SOURCE = "etcd /relaygr/config/trigger"


def ranker(instance_id: str = X, **overrides: Any) -> RankerRecord:
    values: dict[str, Any] = dict(
        instance_id=instance_id,
        address="10.0.0.7:50051",
        model_version="mv-1a2b",
        hbm_budget_bytes=10**9,
        dram_budget_bytes=10**10,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        fixed_ms=1.0,
        per_token_ms=0.125,
        per_pair_ms=2**-10,
        per_candidate_key_ms=2**-8,
        reload_ms_per_mb=0.05,
    )
    values.update(overrides)
    return RankerRecord(**values)


def seen(pinned: int, budget: int = 10**9, queued_ms: float = 0.0) -> RoomReport:
    """A ranker's Describe: `budget` is `ranker()`'s unless said otherwise."""
    return RoomReport(pinned, budget, queued_ms)


def config(**overrides: Any) -> TriggerConfig:
    # defaults: slo 50, margin 5, window 2 s, cooldown 1 s. The room's price binds only once
    # many relays have been asked for (`ask`), so elsewhere the room tests count bytes alone.
    # Relays of prefixes not at risk (relay_spare_share) have tests of their own: here, only
    # what is at risk.
    return TriggerConfig(**{"plaintext": True, "relay_spare_share": 0.0, **overrides})


class Digest:
    """An `Event.digest` that counts its calls."""

    def __init__(self, value: str) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> str:
        self.calls += 1
        return self.value


def event(
    user: str = "user-0",
    *,
    digest: str | Callable[[], str] = "digest-a",
    prefix: int = PREFIX,
    short_term: int = SHORT_TERM,
    candidates: int = AT_RISK,
) -> Event:
    compute = digest if callable(digest) else (lambda: digest)
    return Event(user, prefix, short_term, candidates, compute)


def admitted(digest: str = "digest-a", predicted: float = PREDICTED[AT_RISK]) -> Decision:
    return Decision(Reason.ADMITTED, predicted, X, NBYTES, PREFILL_MS, digest, "", WINDOW_MS)


def relay(
    policy: AdmissionPolicy,
    user: str = "user-0",
    now: float = 0.0,
    digest: str = "digest-a",
    target: RankerRecord | None = None,
) -> Decision:
    """Admit a relay (asserting that it is admitted) and return its decision."""
    decision = policy.decide(event(user, digest=digest), [target or ranker()], now)
    assert decision.admitted, decision
    return decision


# -- admission reasons, table-driven ------------------------------------------------------


def _nothing(policy: AdmissionPolicy, target: RankerRecord) -> None:
    pass


def _in_flight(policy: AdmissionPolicy, target: RankerRecord) -> None:
    relay(policy, target=target)


def _settled(policy: AdmissionPolicy, target: RankerRecord) -> None:
    relay(policy, target=target)
    policy.settled("user-0", "digest-a", X, NBYTES, 0.5)


def _other_user_refused(policy: AdmissionPolicy, target: RankerRecord) -> None:
    policy.refused(relay(policy, "user-1", target=target), "user-1", 0.5)  # until 1.5 > NOW


def _queue_busy(policy: AdmissionPolicy, target: RankerRecord) -> None:
    relay(policy, "user-1", target=target)  # 17.5 ms queued: another 17.5 ends past 25 ms


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    id: str
    reason: Reason
    mode: Mode = Mode.SEQUENCE_AWARE
    candidates: int = AT_RISK
    digest: str = "digest-a"
    has_target: bool = True
    cfg: dict[str, Any] = dataclasses.field(default_factory=dict)
    target: dict[str, Any] = dataclasses.field(default_factory=dict)
    before: Callable[[AdmissionPolicy, RankerRecord], None] = _nothing


BUSY = {"expected_gap_ms": PREFILL_MS}  # one queued prefill: the next would start too late
SMALL_HBM = {"hbm_budget_bytes": 100_000}  # relay budget 90,000 < NBYTES

CASES = [
    Case("off", Reason.RELAY_DISABLED, mode=Mode.OFF),
    Case("off-even-when-cached", Reason.RELAY_DISABLED, mode=Mode.OFF, before=_settled),
    Case("no-ranker", Reason.NO_RANKER, has_target=False),
    Case("no-ranker-mode-all", Reason.NO_RANKER, mode=Mode.ALL, has_target=False),
    Case("within-slo-minus-margin", Reason.NOT_AT_RISK, candidates=SAFE),
    Case("not-at-risk-before-dedup", Reason.NOT_AT_RISK, candidates=SAFE, before=_in_flight),
    Case("at-risk", Reason.ADMITTED),
    Case("same-digest-in-flight", Reason.IN_FLIGHT, before=_in_flight),
    Case("same-digest-settled", Reason.ALREADY_CACHED, before=_settled),
    Case("new-digest-same-user", Reason.ADMITTED, digest="digest-b", before=_settled),
    Case("new-digest-while-in-flight", Reason.ADMITTED, digest="digest-b", before=_in_flight),
    Case("dedup-before-load", Reason.IN_FLIGHT, cfg=BUSY, before=_in_flight),
    Case(
        "dedup-before-footprint",  # a second relay of 96,000 would not fit 100,000
        Reason.IN_FLIGHT,
        cfg={"relay_budget_share": 1.0},
        target=SMALL_HBM,
        before=_in_flight,
    ),
    Case("over-relay-budget", Reason.FOOTPRINT_LIMIT, target=SMALL_HBM),
    Case("target-refused-recently", Reason.NO_ROOM, before=_other_user_refused),
    Case("queue-busy", Reason.LOAD_LIMIT, cfg=BUSY, before=_queue_busy),
    Case(
        "footprint-before-load",
        Reason.FOOTPRINT_LIMIT,
        cfg=BUSY,
        before=lambda p, t: _queue_busy(p, ranker()),
        target=SMALL_HBM,
    ),
    Case("all-not-at-risk", Reason.ADMITTED, mode=Mode.ALL, candidates=SAFE),
    Case("all-over-relay-budget", Reason.ADMITTED, mode=Mode.ALL, target=SMALL_HBM),
    Case("all-after-refusal", Reason.ADMITTED, mode=Mode.ALL, before=_other_user_refused),
    Case("all-queue-busy", Reason.ADMITTED, mode=Mode.ALL, cfg=BUSY, before=_queue_busy),
    Case("all-in-flight", Reason.IN_FLIGHT, mode=Mode.ALL, before=_in_flight),
    Case("all-settled", Reason.ALREADY_CACHED, mode=Mode.ALL, before=_settled),
    Case("all-new-digest", Reason.ADMITTED, mode=Mode.ALL, digest="digest-b", before=_settled),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_admission_reason(case: Case) -> None:
    target = ranker(**case.target)
    # `before` runs in the mode that books relays, then the case's mode applies.
    policy = AdmissionPolicy(config(**case.cfg, mode=Mode.SEQUENCE_AWARE))
    case.before(policy, target)
    policy.reconfigure(config(**case.cfg, mode=case.mode))
    digest = Digest(case.digest)
    ev = event(digest=digest, candidates=case.candidates)
    decision = policy.decide(ev, [target] if case.has_target else [], NOW)

    predicted = PREDICTED[case.candidates]
    if case.reason in (Reason.RELAY_DISABLED, Reason.NO_RANKER):
        assert decision == Decision(case.reason)
        assert digest.calls == 0  # no hashing for events that can never be relayed
    elif case.reason is Reason.NOT_AT_RISK:
        assert decision == Decision(case.reason, predicted, X)
        assert digest.calls == 0
    else:
        window_ms = WINDOW_MS if decision.admitted else 0
        assert decision == Decision(
            case.reason, predicted, X, NBYTES, PREFILL_MS, case.digest, "", window_ms
        )
        assert digest.calls == 1
    assert decision.admitted is (case.reason is Reason.ADMITTED)


def test_at_risk_boundary_is_exact_both_sides() -> None:
    policy = AdmissionPolicy(config())
    assert policy.decide(event("a", candidates=SAFE), [ranker()], NOW).reason is Reason.NOT_AT_RISK
    assert policy.decide(event("b", candidates=AT_RISK), [ranker()], NOW) == admitted()
    # The same 45.625 prediction against a threshold moved by the margin, either side of it.
    policy.reconfigure(config(margin_ms=4.375))  # 50 - 4.375 = 45.625: within, not at risk
    decision = policy.decide(event("c"), [ranker()], NOW)
    assert decision == Decision(Reason.NOT_AT_RISK, 45.625, X)
    policy.reconfigure(config(margin_ms=4.5))  # 45.5 < 45.625
    assert policy.decide(event("c"), [ranker()], NOW).admitted


def test_prediction_uses_prefix_plus_short_term_and_prefill_only_the_prefix() -> None:
    # history 100 + 28 = 128 tokens as before; prefill and bytes follow the 100 prefix tokens.
    ev = event(prefix=100, short_term=28)
    decision = AdmissionPolicy(config()).decide(ev, [ranker(kv_bytes_per_token=3)], NOW)
    prefill = 1 + 100 / 8 + 100 * 100 / 2048
    assert decision == Decision(Reason.ADMITTED, 45.625, X, 300, prefill, "digest-a", "", WINDOW_MS)


def test_already_cached_until_settle_plus_window_then_admitted_again() -> None:
    policy = AdmissionPolicy(config())  # window 2 s
    relay(policy, now=0.0)
    assert policy.decide(event(), [ranker()], 1.9).reason is Reason.IN_FLIGHT
    policy.settled("user-0", "digest-a", X, NBYTES, 1.0)  # resident until 3.0
    assert policy.decide(event(), [ranker()], 2.999).reason is Reason.ALREADY_CACHED
    assert policy.decide(event(), [ranker()], 3.0) == admitted()


def test_in_flight_relay_that_never_settles_lapses_after_one_window() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    assert policy.decide(event(), [ranker()], 1.999).reason is Reason.IN_FLIGHT
    assert policy.decide(event(), [ranker()], 2.0).admitted


@pytest.mark.parametrize(("tokens", "reason"), [(104, Reason.ADMITTED), (105, Reason.NO_ROOM)])
def test_footprint_boundary_is_exact(tokens: int, reason: Reason) -> None:
    # relay budget 400,000 * 0.5 = 200,000 = in flight 104,000 + 96,000 exactly
    policy = AdmissionPolicy(config(relay_budget_share=0.5))
    target = ranker(hbm_budget_bytes=400_000)
    assert policy.decide(event("first", prefix=tokens), [target], NOW).admitted
    decision = policy.decide(event(), [target], NOW)
    assert decision.reason is reason
    assert decision.kv_bytes == NBYTES and decision.digest == "digest-a"


def test_footprint_counts_this_triggers_relays_on_the_same_target_only() -> None:
    policy = AdmissionPolicy(config(relay_budget_share=0.5))
    target = ranker(hbm_budget_bytes=400_000)  # 200,000: room for two relays of 96,000
    relay(policy, "a", target=target)
    relay(policy, "b", target=target)
    assert policy.decide(event("c"), [target], 0.0).reason is Reason.NO_ROOM
    other = ranker("ranker-1", hbm_budget_bytes=400_000)
    assert policy.decide(event("c"), [other], 0.0).admitted


def test_a_relay_in_flight_stops_counting_once_settled_the_ranker_counts_it_pinned() -> None:
    policy = AdmissionPolicy(config(relay_budget_share=0.5))
    target = ranker(hbm_budget_bytes=400_000)
    relay(policy, "a", target=target)
    relay(policy, "b", target=target)
    assert policy.room.in_flight(X, 0.1) == 2 * NBYTES
    policy.settled("a", "digest-a", X, NBYTES, 0.1)
    assert policy.room.in_flight(X, 0.1) == NBYTES
    assert policy.decide(event("c"), [target], 0.1).admitted


def test_a_relay_goes_to_its_owner_however_full_the_view_until_the_owner_refuses() -> None:
    """The ranker has the final word on what is pinned: a room its last report shows full is
    asked anyway while this trigger's relays in flight there leave room; its refusal marks it
    full, and the next relay goes to the next ranker of the order."""
    policy = AdmissionPolicy(config(relay_budget_share=0.5))
    target, other = ranker(hbm_budget_bytes=400_000), ranker("ranker-1", hbm_budget_bytes=400_000)
    policy.room.observe(X, seen(200_000, budget=400_000), NOW)  # the whole relay room pinned
    relay(policy, "a", target=target, now=NOW)
    assert policy.room.held(X, NOW) == 200_000 + NBYTES
    decided = policy.decide(event("b"), [target, other], NOW)
    assert (decided.reason, decided.target) == (Reason.ADMITTED, X)
    policy.refused(decided, "b", NOW)
    decided = policy.decide(event("c"), [target, other], NOW)
    assert (decided.reason, decided.target) == (Reason.ADMITTED, "ranker-1")
    assert policy.decide(event("d"), [target], NOW).reason is Reason.NO_ROOM


def test_refusal_blocks_the_target_until_the_cooldown_passes() -> None:
    policy = AdmissionPolicy(config(refusal_cooldown_ms=1000))
    decision = relay(policy, "a", now=10.0)
    policy.refused(decision, "a", 10.0)  # refused until 11.0
    assert policy.room.held(X, 10.0) == 0  # the refused relay holds nothing
    assert policy.decide(event("a"), [ranker()], 10.0).reason is Reason.NO_ROOM
    assert policy.decide(event("b"), [ranker()], 10.999).reason is Reason.NO_ROOM
    assert policy.decide(event("c", candidates=SAFE), [ranker()], 10.5).reason is (
        Reason.NOT_AT_RISK
    )
    assert policy.decide(event("d"), [ranker("ranker-1")], 10.5).admitted  # other targets are fine
    assert policy.decide(event("b"), [ranker()], 11.0).admitted


def test_an_observation_clears_a_refusal() -> None:
    policy = AdmissionPolicy(config(refusal_cooldown_ms=1000))
    policy.refused(relay(policy, "a", now=10.0), "a", 10.0)
    assert policy.decide(event("b"), [ranker()], 10.2).reason is Reason.NO_ROOM
    policy.room.observe(X, seen(0), 10.3)
    assert policy.decide(event("b"), [ranker()], 10.4).admitted


def test_an_observation_sent_before_the_refusal_does_not_clear_it() -> None:
    policy = AdmissionPolicy(config(refusal_cooldown_ms=1000))
    policy.refused(relay(policy, "a", now=10.0), "a", 10.0)
    policy.room.observe(X, seen(0), 9.9)  # a Describe already in flight when the ranker refused
    assert policy.decide(event("b"), [ranker()], 10.4).reason is Reason.NO_ROOM


def test_a_late_answer_to_an_older_observation_is_ignored() -> None:
    room = AdmissionPolicy(config()).room
    room.observe(X, seen(7000), 2.0)
    room.observe(X, seen(5000), 1.0)
    assert room.held(X, 2.5) == 7000


# -- footprint books -----------------------------------------------------------------------


def test_bytes_held_from_admission_until_an_observation_after_settle_shows_them_gone() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    room = policy.room
    assert room.held(X, 0.0) == NBYTES
    assert room.held("ranker-1", 0.0) == 0
    policy.settled("user-0", "digest-a", X, NBYTES, 0.5)
    assert room.held(X, 0.5) == NBYTES
    room.observe(X, seen(0), 0.4)  # sent before the settle: may predate the pin
    assert room.held(X, 0.6) == NBYTES
    room.observe(X, seen(0), 0.5)  # sent at the settle: the Rank consumed it
    assert room.held(X, 0.6) == 0
    assert policy.decide(event(), [ranker()], 0.6).reason is Reason.ALREADY_CACHED


def test_a_covered_relay_still_pinned_is_counted_once() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    policy.settled("user-0", "digest-a", X, NBYTES, 0.5)
    policy.room.observe(X, seen(NBYTES + 1000), 0.7)  # its pin and another of 1,000 bytes
    assert policy.room.held(X, 0.8) == NBYTES + 1000


def test_relays_due_since_the_last_report_count_as_consumed_in_the_share_ranked() -> None:
    # A quarter of relays are never ranked (the prior, nothing measured yet): once a relay's
    # Rank is due (1 s after admission), three quarters of its bytes are taken as freed. The
    # owner's room (one relay) has room to spare for a relay not at risk only once most of the
    # first is taken as freed.
    def trigger(no_show_prior: float) -> AdmissionPolicy:
        policy = AdmissionPolicy(
            config(
                expected_gap_ms=1000, no_show_prior=no_show_prior, relay_budget_share=1.0,
                relay_spare_share=1.0,
            )
        )  # fmt: skip
        relay(policy, now=0.0, target=ranker(hbm_budget_bytes=NBYTES))
        policy.settled("user-0", "digest-a", X, NBYTES, 0.2)
        policy.room.observe(X, seen(NBYTES, NBYTES), 0.5)  # counted pinned: not due yet
        return policy

    def spare(policy: AdmissionPolicy, now: float) -> Reason:
        return policy.decide(event("b", candidates=SAFE), [ranker()], now).reason

    assert spare(trigger(no_show_prior=0.25), 0.999) is Reason.NOT_AT_RISK
    assert spare(trigger(no_show_prior=0.25), 1.0) is Reason.SPARE
    room = trigger(no_show_prior=0.25).room
    assert room.held(X, 1.0, ranked=0.75) == NBYTES / 4
    assert room.held(X, 1.0) == NBYTES  # the router's view: no share ranked, nothing taken
    # A report sent after the Rank was due says what happened: nothing more is taken off.
    room.observe(X, seen(NBYTES), 1.1)  # a no-show, still pinned
    assert room.held(X, 1.2, ranked=0.75) == NBYTES
    # With every relay assumed a no-show (the default prior), nothing is taken off either.
    assert spare(trigger(no_show_prior=1.0), 1.5) is Reason.NOT_AT_RISK


def test_settle_records_where_the_relay_landed_and_its_size() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    policy.settled("user-0", "digest-a", "ranker-1", 5000, 0.5)
    assert (policy.room.held(X, 0.5), policy.room.held("ranker-1", 0.5)) == (0, 5000)
    policy.settled("user-0", "digest-old", X, 7000, 0.6)  # not this relay: ignored
    assert policy.room.held("ranker-1", 0.6) == 5000


def test_unobserved_relay_is_released_when_it_expires() -> None:
    policy = AdmissionPolicy(config())  # window 2 s
    relay(policy, now=0.0)
    policy.settled("user-0", "digest-a", X, NBYTES, 0.5)
    assert policy.room.held(X, 2.499) == NBYTES
    assert policy.room.held(X, 2.5) == 0


def test_an_observation_counts_for_one_window_after_it_was_taken() -> None:
    room = AdmissionPolicy(config()).room
    room.observe(X, seen(5000), 1.0)
    assert [room.held(X, t) for t in (1.0, 2.999, 3.0)] == [5000, 5000, 0]
    room.observe(X, seen(7000), 2.0)  # the latest observation replaces the earlier one
    assert room.held(X, 2.5) == 7000


def test_fail_returns_the_bytes_of_that_relay_only() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    policy.failed("user-0", "digest-other")
    assert policy.room.held(X, 0.0) == NBYTES
    policy.failed("user-0", "digest-a")
    assert policy.room.held(X, 0.0) == 0
    assert policy.decide(event(), [ranker()], 0.0).admitted  # nothing left to deduplicate


def test_sweep_drops_expired_relays_and_departed_instances() -> None:
    policy = AdmissionPolicy(config())
    room = policy.room
    relay(policy, "old", now=0.0)  # expires at 2.0
    relay(policy, "new", now=1.0)  # expires at 3.0
    room.observe(X, seen(10), 1.0)
    room.observe("ranker-1", seen(20), 1.0)
    relay(policy, "elsewhere", now=1.0)
    policy.settled("elsewhere", "digest-a", "ranker-1", NBYTES, 1.0)
    room.refuse(X, 1.0, 5.0)
    room.refuse("ranker-1", 1.0, 5.0)
    room.sweep(2.0, {X: ranker()})
    # Not expired, nor on a departed ranker (relays are keyed by user, version and prefix).
    assert set(room.relays) == {("new", "", "digest-a")}
    assert set(room.observed) == {X}
    assert set(room.refusals) == {X}
    assert room.held(X, 2.0) == 10 + NBYTES


def test_reconfigure_applies_a_new_window() -> None:
    policy = AdmissionPolicy(config())
    policy.reconfigure(config(relay_window_ms=500))
    relay(policy, now=0.0)  # in flight until 0.5
    assert policy.decide(event(), [ranker()], 0.499).reason is Reason.IN_FLIGHT
    assert policy.room.held(X, 0.5) == 0
    relay(policy, "b", now=1.0)
    policy.settled("b", "digest-a", X, NBYTES, 1.0)
    assert [policy.room.held(X, t) for t in (1.499, 1.5)] == [NBYTES, 0]
    policy.room.observe(X, seen(42), 2.0)
    assert [policy.room.held(X, t) for t in (2.499, 2.5)] == [42, 0]


def test_a_users_new_relay_keeps_the_pinned_bytes_of_the_previous_one() -> None:
    # RelayLedger: "A relay's bytes are released when it fails, expires, or is covered."
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0, digest="digest-a")
    policy.settled("user-0", "digest-a", X, NBYTES, 0.1)
    relay(policy, now=0.2, digest="digest-b")
    assert policy.room.held(X, 0.2) == 2 * NBYTES


# -- live config ---------------------------------------------------------------------------


def test_live_fields_are_the_admission_policy_fields() -> None:
    names = {f.name for f in dataclasses.fields(TriggerConfig)}
    assert set(LIVE_FIELDS) <= names
    assert {"listen", "etcd_endpoints", "dispatch_queue", "max_candidates"}.isdisjoint(LIVE_FIELDS)


def test_live_override_accepted_and_applied_to_the_policy() -> None:
    base = config()
    data = {"mode": "all", "slo_ms": 80, "margin_ms": 7.5, "relay_window_ms": 500}
    cfg = override_config(base, data, LIVE_FIELDS, SOURCE)
    assert (cfg.mode, cfg.slo_ms, cfg.margin_ms, cfg.relay_window_s) == (Mode.ALL, 80.0, 7.5, 0.5)
    assert isinstance(cfg.slo_ms, float)
    assert dataclasses.replace(cfg, **{k: getattr(base, k) for k in data}) == base
    assert override_config(base, {}, LIVE_FIELDS, SOURCE) == base
    assert base.mode is Mode.SEQUENCE_AWARE  # the base is untouched
    policy = AdmissionPolicy(base)
    policy.reconfigure(override_config(base, {"mode": "off"}, LIVE_FIELDS, SOURCE))
    assert policy.decide(event(), [ranker()], NOW).reason is Reason.RELAY_DISABLED


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"bogus": 1}, ["bogus"]),
        ({"listen": "0.0.0.0:1"}, ["listen"]),
        ({"slo_ms": 60, "dispatch_queue": 9}, ["dispatch_queue"]),
        ({"slo_ms": "fast"}, ["slo_ms", "'fast'"]),
        ({"slo_ms": True}, ["slo_ms"]),
        ({"relay_window_ms": 2.5}, ["relay_window_ms"]),
        ({"relay_window_ms": 0}, ["relay_window_ms"]),
        ({"margin_ms": 50}, ["margin_ms"]),
        ({"slo_ms": 5}, ["margin_ms"]),  # the default margin 5 is then not below slo_ms
        ({"prefill_share": 1.5}, ["prefill_share"]),
        ({"relay_budget_share": 0}, ["relay_budget_share"]),
        ({"mode": "sometimes"}, ["mode", "off", "all", "sequence-aware"]),
        ({"mode": 1}, ["mode"]),
    ],
    ids=lambda v: ",".join(f"{k}={x!r}" for k, x in v.items()) if isinstance(v, dict) else "",
)
def test_live_override_rejected_naming_key_and_source(
    data: dict[str, Any], named: list[str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        override_config(config(), data, LIVE_FIELDS, SOURCE)
    message = str(caught.value)
    for text in [SOURCE, *named]:
        assert text in message, message


# -- the fallback order: room and time where the router will send it ------------------------

Y, Z = "ranker-1", "ranker-2"
ORDER = (X, Y, Z)  # the user's fallback order, owner first
FULL = seen(10**9 - NBYTES + 1)  # one byte short of room for the relay
BUSY_QUEUE = seen(0, queued_ms=1000)  # the prefill would start as its Rank arrives: too late


@dataclasses.dataclass(frozen=True, slots=True)
class Walk:
    id: str
    reason: Reason
    target: str  # the decision's target: where admitted, else the owner
    views: dict[str, RoomReport] = dataclasses.field(default_factory=dict)
    refused: tuple[str, ...] = ()
    budgets: dict[str, int] = dataclasses.field(default_factory=dict)


WALKS = [
    Walk("owner-has-room", Reason.ADMITTED, X),
    Walk("owner-full-in-the-view-is-still-asked", Reason.ADMITTED, X, {X: FULL}),
    Walk("owner-refused-second-has-room", Reason.ADMITTED, Y, refused=(X,)),
    Walk("owner-and-second-refused", Reason.ADMITTED, Z, refused=(X, Y)),
    Walk("all-refused", Reason.NO_ROOM, X, {Y: FULL}, refused=ORDER),
    Walk("owner-too-small-ever", Reason.ADMITTED, Y, budgets={X: NBYTES - 1}),
    Walk("larger-than-every-budget", Reason.FOOTPRINT_LIMIT, X, budgets=dict.fromkeys(ORDER, 1)),
    Walk("too-small-or-refused", Reason.NO_ROOM, X, refused=(Y, Z), budgets={X: 1}),
    Walk("owner-queue-busy-second-idle", Reason.ADMITTED, Y, {X: BUSY_QUEUE}),
    Walk("every-queue-busy", Reason.LOAD_LIMIT, X, dict.fromkeys(ORDER, BUSY_QUEUE)),
    Walk("refused-or-busy", Reason.LOAD_LIMIT, X, {Y: BUSY_QUEUE}, refused=(X, Z)),
    Walk("busy-or-refused", Reason.LOAD_LIMIT, X, {X: BUSY_QUEUE}, refused=(Y, Z)),
]


@pytest.mark.parametrize("walk", WALKS, ids=[w.id for w in WALKS])
def test_admission_walks_the_fallback_order(walk: Walk) -> None:
    policy = AdmissionPolicy(config(relay_budget_share=1.0))  # gap 1,000 ms, margin 5
    order = [ranker(i, hbm_budget_bytes=walk.budgets.get(i, 10**9)) for i in ORDER]
    for instance, view in walk.views.items():
        policy.room.observe(instance, view, NOW - 0.5)
    for instance in walk.refused:
        policy.room.refuse(instance, NOW - 0.1)
    decision = policy.decide(event(), order, NOW)
    window_ms = WINDOW_MS if decision.admitted else 0
    assert decision == Decision(
        walk.reason, PREDICTED[AT_RISK], walk.target, NBYTES, PREFILL_MS, "digest-a", "", window_ms
    )
    assert policy.room.held(walk.target, NOW) == (
        (NBYTES if decision.admitted else 0)
        + (FULL.pinned_bytes if walk.views.get(walk.target) == FULL else 0)
    )


def test_each_ranker_is_judged_by_its_own_bytes_per_token_and_cost_model() -> None:
    policy = AdmissionPolicy(config(relay_budget_share=1.0))
    owner = ranker(X, hbm_budget_bytes=NBYTES)  # room for exactly one relay
    second = ranker(Y, hbm_budget_bytes=960, kv_bytes_per_token=10, per_token_ms=0.25)
    assert policy.decide(event("a"), [owner, second], NOW).target == X
    # 96 tokens: more than the owner's budget in its bytes, exactly the second's in its own;
    # prefill(96) there = 1 + 24 + 4.5 ms.
    owner = ranker(X, hbm_budget_bytes=NBYTES - 1)
    decision = policy.decide(event("b"), [owner, second], NOW)
    assert decision == Decision(
        Reason.ADMITTED, PREDICTED[AT_RISK], Y, 960, 29.5, "digest-a", "", WINDOW_MS
    )


def test_the_owner_predicts_whether_the_request_is_at_risk() -> None:
    slow = ranker(Y, per_candidate_key_ms=1.0)  # the second ranker alone would call it at risk
    decision = AdmissionPolicy(config()).decide(event(candidates=SAFE), [ranker(), slow], NOW)
    assert decision == Decision(Reason.NOT_AT_RISK, PREDICTED[SAFE], X)


def test_the_owners_queued_rank_work_puts_a_request_at_risk_boundary_exact() -> None:
    # The SAFE request: full inference 45.0 against slo - margin = 45.0, at risk by any wait.
    def decide(queued_rank_ms: float) -> Decision:
        policy = AdmissionPolicy(config())
        report = RoomReport(0, 10**9, queued_rank_ms=queued_rank_ms)
        policy.room.observe(X, report, NOW)
        policy.room.observe(Y, RoomReport(0, 10**9, queued_rank_ms=100.0), NOW)  # not the owner
        return policy.decide(event(candidates=SAFE), [ranker(), ranker(Y)], NOW)

    assert decide(0.0) == Decision(Reason.NOT_AT_RISK, PREDICTED[SAFE], X)  # idle owner
    assert decide(2**-10).admitted  # 45.0 + 2^-10 > 45.0: exact in binary
    assert decide(30.0).admitted and decide(30.0).target == X  # a long rank queue
    # The AT_RISK request sits 0.625 past the line: no queue can make it safe.
    policy = AdmissionPolicy(config(margin_ms=4.375))  # line at 45.625: within
    policy.room.observe(X, RoomReport(0, 10**9, queued_rank_ms=0.0), NOW)
    assert policy.decide(event(), [ranker()], NOW).reason is Reason.NOT_AT_RISK
    policy = AdmissionPolicy(config(margin_ms=4.375))
    policy.room.observe(X, RoomReport(0, 10**9, queued_rank_ms=2**-10), NOW)
    assert policy.decide(event(), [ranker()], NOW).admitted


def test_a_stale_rank_queue_ages_out_to_unknown_and_zero() -> None:
    policy = AdmissionPolicy(config())  # window 2 s
    policy.room.observe(X, RoomReport(0, 10**9, queued_rank_ms=30.0), NOW)
    assert policy.decide(event("a", candidates=SAFE), [ranker()], NOW + 1.9).admitted
    decision = policy.decide(event("b", candidates=SAFE), [ranker()], NOW + 2.0)
    assert decision.reason is Reason.NOT_AT_RISK


def test_mode_all_relays_to_the_owner_whatever_its_room() -> None:
    policy = AdmissionPolicy(config(mode=Mode.ALL))
    policy.room.observe(X, FULL, NOW)
    decision = policy.decide(event(), [ranker(), ranker(Y)], NOW)
    assert decision.admitted and decision.target == X


def test_a_stale_view_ages_out_to_unknown() -> None:
    policy = AdmissionPolicy(config())  # window 2 s: every pin it counted is gone after it
    policy.room.observe(X, FULL, 1.0)
    assert policy.room.report(X, 2.999) == FULL
    assert policy.room.held(X, 2.999) == FULL.pinned_bytes
    assert policy.room.report(X, 3.0) is None  # unknown: only this trigger's relays count
    assert policy.room.held(X, 3.0) == 0


def test_a_refusal_marks_the_ranker_full_until_an_observation_sent_after_it() -> None:
    policy = AdmissionPolicy(config(refusal_cooldown_ms=1000))
    order = [ranker(), ranker(Y)]
    first = policy.decide(event("a"), order, 10.0)
    assert first.target == X
    policy.refused(first, "a", 10.1)
    assert policy.decide(event("b"), order, 10.2).target == Y  # learnt: X is full
    policy.room.observe(X, seen(0), 10.05)  # asked before the refusal: says nothing of it
    assert policy.decide(event("c"), order, 10.3).target == Y
    policy.room.observe(X, seen(0), 10.4)  # asked after it: room again
    assert policy.decide(event("d"), order, 10.5).target == X


def test_a_relay_that_landed_elsewhere_holds_its_bytes_there() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, "a", now=0.0)
    policy.settled("a", "digest-a", Y, NBYTES, 0.1)  # the router fell back to Y
    assert (policy.room.held(X, 0.1), policy.room.held(Y, 0.1)) == (0, NBYTES)
    # X refused it before queueing its prefill; Y ran it, and it is done
    assert policy.room.queued_ms(X, 0.1) == policy.room.queued_ms(Y, 0.1) == 0.0


# -- load: queued prefill in the cost model's milliseconds ----------------------------------


@pytest.mark.parametrize(
    ("queued_ms", "reason"),
    [(1000 - 0.25, Reason.ADMITTED), (1000, Reason.LOAD_LIMIT)],
)
def test_load_limit_boundary_is_exact(queued_ms: float, reason: Reason) -> None:
    # the prefill must start before its Rank is expected: queued < expected_gap_ms = 1000
    policy = AdmissionPolicy(config())
    policy.room.observe(X, seen(0, queued_ms=queued_ms), NOW)
    assert policy.decide(event(), [ranker()], NOW).reason is reason


def test_prefill_admitted_since_the_observation_counts_until_one_sent_after_it() -> None:
    policy = AdmissionPolicy(config(expected_gap_ms=2 * PREFILL_MS))  # a third starts too late
    policy.room.observe(X, seen(0, queued_ms=0.0), 0.0)
    relay(policy, "a", now=0.1)
    relay(policy, "b", now=0.2)
    assert policy.room.queued_ms(X, 0.3) == 2 * PREFILL_MS
    assert policy.decide(event("c"), [ranker()], 0.3).reason is Reason.LOAD_LIMIT
    policy.room.observe(X, seen(0, queued_ms=PREFILL_MS), 0.15)  # "a" queued, "b" not yet sent
    assert policy.room.queued_ms(X, 0.3) == 2 * PREFILL_MS
    assert policy.decide(event("c"), [ranker()], 0.3).reason is Reason.LOAD_LIMIT
    policy.room.observe(X, seen(0, queued_ms=0.0), 0.25)  # both done
    assert policy.decide(event("c"), [ranker()], 0.3).admitted


def test_a_failed_relay_releases_its_prefill_at_once() -> None:
    policy = AdmissionPolicy(config(expected_gap_ms=PREFILL_MS))  # room for one prefill
    relay(policy, "a", now=0.0)
    assert policy.decide(event("b"), [ranker()], 0.0).reason is Reason.LOAD_LIMIT
    policy.failed("a", "digest-a")
    assert policy.decide(event("b"), [ranker()], 0.0).admitted


def test_an_old_queue_figure_ages_out_with_the_view() -> None:
    policy = AdmissionPolicy(config())
    policy.room.observe(X, seen(0, queued_ms=10_000.0), 0.0)
    assert policy.decide(event("a"), [ranker()], 1.0).reason is Reason.LOAD_LIMIT
    assert policy.decide(event("a"), [ranker()], 2.0).admitted


# -- load: only the no-shows' share of queued prefill runs ahead of a relay -----------------


def ends(consumed: int, unconsumed: int, queued_ms: float = 0.0) -> RoomReport:
    """A Describe of ranker X: its relays' ends since start, and its queued prefill."""
    return RoomReport(0, 10**9, queued_ms, 0.0, consumed, unconsumed)


def test_relay_ends_are_counted_between_observations_and_from_zero_after_a_restart() -> None:
    policy = AdmissionPolicy(config())
    policy.room.observe(X, ends(500, 100), 0.0)  # since the ranker started: not this trigger's
    assert (policy.room.ends.consumed, policy.room.ends.unconsumed) == (0, 0)
    policy.room.observe(X, ends(530, 110), 0.0)
    assert (policy.room.ends.consumed, policy.room.ends.unconsumed) == (30, 10)
    policy.room.observe(X, ends(4, 0), 0.0)  # it restarted: counted from zero
    assert (policy.room.ends.consumed, policy.room.ends.unconsumed) == (34, 10)
    policy.room.observe(X, ends(4, 0), 0.0)  # nothing ended since
    assert (policy.room.ends.consumed, policy.room.ends.unconsumed) == (34, 10)


def test_the_no_show_share_is_the_prior_until_relays_end_then_what_they_show() -> None:
    policy = AdmissionPolicy(config(no_show_prior=0.5))
    assert policy.no_show_share() == 0.5  # nothing ended: the prior
    policy.room.observe(X, ends(0, 0), 0.0)
    policy.room.observe(X, ends(20, 0), 0.0)  # as many ends as the prior weighs
    assert policy.no_show_share() == 0.25
    policy.room.observe(X, ends(20 + 980, 0), 0.0)
    assert policy.no_show_share() == pytest.approx(10 / 1020)
    # Counts halve every half-life: after one, 500 consumed; then 1,000 no-shows end.
    policy.room.observe(X, ends(1000, 1000), policy.room.ends.half_life_s)
    assert policy.no_show_share() == pytest.approx((1000 + 10) / (500 + 1000 + 20))


@pytest.mark.parametrize(
    ("shows", "queued_ms", "reason"),
    [
        (0.5, 2000 - 0.5, Reason.ADMITTED),  # half of it runs ahead: 999.75 < the 1,000 ms gap
        (0.5, 2000, Reason.LOAD_LIMIT),
        (0.0, 10**6, Reason.ADMITTED),  # every relay is ranked: each promotes its own prefill
        (1.0, 1000, Reason.LOAD_LIMIT),  # none is: the whole queue runs ahead
    ],
)
def test_only_the_no_shows_share_of_queued_prefill_delays_a_relay(
    shows: float, queued_ms: float, reason: Reason
) -> None:
    # The prior alone sets the share here (nothing has ended); the gap is 1,000 ms.
    policy = AdmissionPolicy(config(no_show_prior=shows))
    policy.room.observe(X, seen(0, queued_ms=queued_ms), NOW)
    assert policy.decide(event(), [ranker()], NOW).reason is reason


def test_relays_seen_consumed_lift_the_load_limit_and_no_shows_bring_it_back() -> None:
    # A queue of twice the gap: too late while every relay is assumed a no-show (the prior 1).
    policy = AdmissionPolicy(config())
    policy.room.observe(X, ends(0, 0, queued_ms=2000), 0.0)
    assert policy.decide(event("a"), [ranker()], 0.0).reason is Reason.LOAD_LIMIT
    policy.room.observe(X, ends(380, 0, queued_ms=2000), 0.0)  # share 20 / 400 = 0.05
    assert policy.decide(event("a"), [ranker()], 0.0).admitted
    policy.room.observe(X, ends(380, 600, queued_ms=2000), 0.0)  # 620 / 1,000: 1,240 ms ahead
    assert policy.decide(event("b"), [ranker()], 0.0).reason is Reason.LOAD_LIMIT


# -- model versions -------------------------------------------------------------------------


def test_relays_are_booked_per_model_version() -> None:
    policy = AdmissionPolicy(config())
    v1, v2 = ranker(X, model_version="v1"), ranker("ranker-1", model_version="v2")
    first = policy.decide(dataclasses.replace(event(), model_version="v1"), [v1], NOW)
    assert first.admitted and first.model_version == "v1" and first.target == X
    again = policy.decide(dataclasses.replace(event(), model_version="v1"), [v1], NOW)
    assert again.reason is Reason.IN_FLIGHT and again.model_version == "v1"
    # The same user and prefix under v2: another relay, judged on v2's ranker.
    other = policy.decide(dataclasses.replace(event(), model_version="v2"), [v2], NOW)
    assert other.admitted and (other.model_version, other.target) == ("v2", "ranker-1")
    policy.settled("user-0", "digest-a", X, NBYTES, NOW, "v1")
    assert policy.room.live(("user-0", "v1", "digest-a"), NOW) is not None
    policy.failed("user-0", "digest-a", "v2")
    assert policy.room.live(("user-0", "v2", "digest-a"), NOW) is None
    cached = policy.decide(dataclasses.replace(event(), model_version="v1"), [v1], NOW)
    assert cached.reason is Reason.ALREADY_CACHED


def ask(policy: AdmissionPolicy, n: int, prefix: int, start: float, per_s: float) -> None:
    """`n` at-risk relays of `prefix` tokens asked for from `start`, `per_s` a second (users
    `flow-*`), whether or not they are admitted."""
    target = ranker(hbm_budget_bytes=250_000)
    for i in range(n):
        policy.decide(event(f"flow-{i}", prefix=prefix), [target], start + i / per_s)


def test_binding_room_admits_more_violations_saved_per_byte_whatever_the_arrival_order() -> None:
    # Both at risk, so each saves one violation: the short prefix (96,000 bytes) saves more per
    # byte than the long one (192,000). Room for one of them, not both (250,000). Short relays
    # have been asked for at 10 a second: held 2 s each (the no-show prior 1: their window),
    # they alone would fill the room, so the long one is priced out even into an empty room.
    short, long = event("short", prefix=PREFIX), event("long", prefix=2 * PREFIX)
    target = ranker(hbm_budget_bytes=250_000)
    later = NOW + 10.0  # the flow's relays have all expired

    def admitted_of(first: Event, second: Event, flow: int) -> list[str]:
        policy = AdmissionPolicy(config(relay_budget_share=1.0))
        ask(policy, flow, PREFIX, NOW, per_s=10)
        decisions = [(e.user_id, policy.decide(e, [target], later)) for e in (first, second)]
        return [user for user, d in decisions if d.admitted]

    assert admitted_of(long, short, flow=40) == ["short"]
    assert admitted_of(short, long, flow=40) == ["short"]
    policy = AdmissionPolicy(config(relay_budget_share=1.0))
    ask(policy, 40, PREFIX, NOW, per_s=10)
    assert policy.decide(long, [target], later).reason is Reason.NO_ROOM
    # No short ones asked for: the room does not bind, first come, first served.
    assert admitted_of(long, short, flow=0) == ["long"]


def test_the_room_a_flow_fills_is_every_ranker_s_of_the_order() -> None:
    # The flow of short relays asked for, held for their window, against a long relay whose
    # order has k rankers of 200,000 bytes: priced out while k rooms are no more than the flow
    # holds, admitted with one ranker more (the rooms are summed over the whole order).
    long = event("long", prefix=2 * PREFIX)
    later = NOW + 10.0
    policy = AdmissionPolicy(config(relay_budget_share=1.0))
    ask(policy, 40, PREFIX, NOW, per_s=10)
    held = policy.demand.held_below(2 * NBYTES, policy.hold_s(policy.cfg.relay_window_s), later)
    k = int(held // 200_000)
    assert k >= 2, held

    def reason(rankers: int) -> Reason:
        fresh = AdmissionPolicy(config(relay_budget_share=1.0))
        ask(fresh, 40, PREFIX, NOW, per_s=10)
        order = [ranker(f"r{i}", hbm_budget_bytes=200_000) for i in range(rankers)]
        return fresh.decide(long, order, later).reason

    assert reason(k) is Reason.NO_ROOM
    assert reason(k + 1) is Reason.ADMITTED


def test_a_relay_that_fits_an_empty_room_is_admitted_while_the_room_does_not_bind() -> None:
    # 240,000 of 250,000 bytes: nearly the whole room, and nothing smaller asked for.
    target = ranker(hbm_budget_bytes=250_000)
    policy = AdmissionPolicy(config(relay_budget_share=1.0))
    assert policy.decide(event("long", prefix=240), [target], NOW).admitted
    # A few short relays asked for (one a second, 96,000 bytes held 2 s: 192,000 of 250,000)
    # leave room for it too, once the first has gone.
    policy = AdmissionPolicy(config(relay_budget_share=1.0))
    ask(policy, 4, PREFIX, NOW, per_s=1)
    assert policy.decide(event("long", prefix=240), [target], NOW + 10.0).admitted


def test_how_long_a_relay_holds_room_follows_the_no_show_share() -> None:
    # The same flow of short relays: held for their window (2 s) it fills the room, held until
    # their Rank (the 100 ms gap) it does not.
    long = event("long", prefix=2 * PREFIX)
    for prior, admitted in ((1.0, False), (0.0, True)):
        policy = AdmissionPolicy(
            config(relay_budget_share=1.0, expected_gap_ms=100, no_show_prior=prior)
        )
        assert policy.hold_s(policy.cfg.relay_window_s) == pytest.approx(2.0 if prior else 0.1)
        ask(policy, 40, PREFIX, NOW, per_s=10)
        assert policy.decide(long, [ranker(hbm_budget_bytes=250_000)], NOW + 10).admitted is (
            admitted
        )


def test_the_room_is_exact_and_follows_what_is_held() -> None:
    policy = AdmissionPolicy(config(relay_budget_share=1.0))
    # 96,000 bytes: a room of 96,000 admits it exactly, 95,999 not.
    assert policy.decide(event("a"), [ranker(hbm_budget_bytes=NBYTES)], NOW).admitted
    policy = AdmissionPolicy(config(relay_budget_share=1.0))
    decision = policy.decide(event("a"), [ranker(hbm_budget_bytes=NBYTES - 1)], NOW)
    assert decision.reason is Reason.FOOTPRINT_LIMIT
    # A ranker that refused a relay for room is full until it reports again: the relay spills
    # to the next ranker of the order.
    policy = AdmissionPolicy(config(relay_budget_share=1.0))
    policy.room.refuse(X, NOW)
    decision = policy.decide(event("b"), [ranker(), ranker(Y)], NOW)
    assert decision.admitted and decision.target == Y


# -- relays not at risk, while the owner has room and time to spare ----------------------------


def test_a_relay_not_at_risk_goes_to_its_owner_while_room_and_time_are_spare() -> None:
    policy = AdmissionPolicy(config(relay_spare_share=0.5))  # relay room 0.9 * 10^9
    safe = policy.decide(event("a", candidates=SAFE), [ranker()], NOW)
    assert safe == dataclasses.replace(admitted(predicted=PREDICTED[SAFE]), reason=Reason.SPARE)
    assert safe.admitted
    # an at-risk relay is placed as before, and says it was at risk
    assert policy.decide(event("b", candidates=AT_RISK), [ranker()], NOW).reason is (
        Reason.ADMITTED
    )


def test_past_the_spare_mark_only_relays_at_risk_go() -> None:
    policy = AdmissionPolicy(config(relay_spare_share=0.5))
    half = int(10**9 * 0.9 * 0.5)
    policy.room.observe(X, seen(pinned=half), NOW)  # exactly half the relay room held
    assert policy.decide(event("a", candidates=SAFE), [ranker()], NOW).reason is (
        Reason.NOT_AT_RISK
    )
    assert policy.decide(event("b", candidates=AT_RISK), [ranker()], NOW).admitted
    below = AdmissionPolicy(config(relay_spare_share=0.5))
    below.room.observe(X, seen(pinned=half - NBYTES), NOW)
    assert below.decide(event("a", candidates=SAFE), [ranker()], NOW).admitted


def test_a_relay_not_at_risk_waits_for_no_queued_prefill_and_never_spills() -> None:
    busy = AdmissionPolicy(config(relay_spare_share=0.5, expected_gap_ms=100))
    busy.room.observe(X, seen(pinned=0, queued_ms=50.0), NOW)  # half the gap queued
    assert busy.decide(event("a", candidates=SAFE), [ranker()], NOW).reason is (Reason.NOT_AT_RISK)
    # the owner refused for room: a relay not at risk is not sent down the order
    refused = AdmissionPolicy(config(relay_spare_share=0.5))
    refused.room.refuse(X, NOW)
    other = ranker("ranker-1")
    decision = refused.decide(event("a", candidates=SAFE), [ranker(), other], NOW)
    assert decision.reason is Reason.NOT_AT_RISK


def offer(policy: AdmissionPolicy, n: int, prefix: int, start: float, per_s: float) -> None:
    """`n` retrievals not at risk of `prefix` tokens, from `start`, `per_s` a second (users
    `offer-*`), whatever was decided for them."""
    target = ranker(hbm_budget_bytes=250_000)
    for i in range(n):
        policy.decide(
            event(f"offer-{i}", prefix=prefix, candidates=SAFE), [target], start + i / per_s
        )


def test_where_the_room_binds_a_spare_relay_goes_to_the_longer_prefixes() -> None:
    # Longer prefixes (192,000 bytes) offered at 10 a second, each held 2 s (the no-show prior
    # 1: their window), would fill the 250,000-byte room alone: a shorter one not at risk is
    # outvalued even into an empty room, while one as long as theirs is still spared. An SLO
    # of 1 s puts none of them at risk.
    target = ranker(hbm_budget_bytes=250_000)
    later = NOW + 10.0  # the offered relays have all expired; their rate has not

    def decided(prefix: int, flow: int, slo_ms: float = 1000.0) -> Reason:
        cfg = config(relay_budget_share=1.0, relay_spare_share=1.0, slo_ms=slo_ms)
        policy = AdmissionPolicy(cfg)
        offer(policy, flow, 2 * PREFIX, NOW, per_s=10)
        return policy.decide(event("u", prefix=prefix), [target], later).reason

    assert decided(PREFIX, flow=40) is Reason.NOT_AT_RISK
    assert decided(2 * PREFIX, flow=40) is Reason.SPARE
    # A short relay at risk saves a violation: the longer prefixes offered (at risk too, at
    # this SLO) do not price it out.
    assert decided(PREFIX, flow=40, slo_ms=50.0) is Reason.ADMITTED
    # Nothing longer offered, or too little to fill the room: the short one is spared.
    assert decided(PREFIX, flow=0) is Reason.SPARE
    policy = AdmissionPolicy(config(relay_budget_share=1.0, relay_spare_share=1.0, slo_ms=1000))
    offer(policy, 4, 2 * PREFIX, NOW, per_s=1)  # 192,000 bytes a second at most, held 2 s
    assert (
        policy.hold_s(policy.cfg.relay_window_s) * policy.offered.rate_above(NBYTES, later)
        < 250_000
    )
    assert policy.decide(event("u"), [target], later).reason is Reason.SPARE


def test_spare_share_zero_relays_only_what_is_at_risk() -> None:
    policy = AdmissionPolicy(config(relay_spare_share=0.0))
    assert policy.decide(event("a", candidates=SAFE), [ranker()], NOW).reason is (
        Reason.NOT_AT_RISK
    )


def waits(p99_ms: float, budget: int = 10**9) -> RoomReport:
    """A ranker's Describe with nothing pinned and `p99_ms` as its relays' wait tail."""
    return RoomReport(0, budget, relay_wait_p99_ms=p99_ms)


@pytest.mark.parametrize(
    ("factor", "report", "window_ms"),
    [
        (3.0, waits(100.0), 300),  # three times the tail
        (3.0, waits(1000.0), WINDOW_MS),  # at most relay_window_ms
        (3.0, waits(0.0), WINDOW_MS),  # too few Ranks there yet to know
        (3.0, None, WINDOW_MS),  # never reported
        (0.0, waits(100.0), WINDOW_MS),  # off
    ],
)
def test_a_relay_asks_for_a_window_of_its_ranker_s_wait_tail(
    factor: float, report: RoomReport | None, window_ms: int
) -> None:
    policy = AdmissionPolicy(config(relay_window_wait_factor=factor))
    if report is not None:
        policy.room.observe(X, report, NOW - 0.1)
    decision = policy.decide(event("a"), [ranker()], NOW)
    assert decision.relay_window_ms == window_ms
    # In flight until its dispatch deadline (the longest window), then booked for its own.
    assert policy.room.live(("a", "", "digest-a"), NOW + WINDOW_MS / 1e3 - 1e-6)
    policy.room.settle(("a", "", "digest-a"), X, NBYTES, NOW + 0.05)
    assert policy.room.live(("a", "", "digest-a"), NOW + 0.05 + window_ms / 1e3 - 1e-6)
    assert policy.room.live(("a", "", "digest-a"), NOW + 0.05 + window_ms / 1e3) is None


def test_a_stale_wait_tail_is_not_used() -> None:
    policy = AdmissionPolicy(config(relay_window_wait_factor=3.0))
    policy.room.observe(X, waits(100.0), NOW - 2.0)  # one relay window ago: says nothing now
    assert policy.decide(event("a"), [ranker()], NOW).relay_window_ms == WINDOW_MS


def test_no_shows_held_for_a_shorter_window_leave_room_for_a_longer_prefix() -> None:
    # Every relay a no-show (prior 1): short relays at 10 a second, each held its 2 s window,
    # fill the 250,000-byte room and price the long one out; held 300 ms (three times a 100 ms
    # tail) they leave room for it.
    long = event("long", prefix=2 * PREFIX)
    target = ranker(hbm_budget_bytes=250_000)
    for factor, admitted in ((0.0, False), (3.0, True)):
        policy = AdmissionPolicy(
            config(
                relay_budget_share=1.0, expected_gap_ms=100, no_show_prior=1.0,
                relay_window_wait_factor=factor,
            )
        )  # fmt: skip
        ask(policy, 40, PREFIX, NOW, per_s=10)
        policy.room.observe(X, waits(100.0, budget=250_000), NOW + 9.9)
        assert policy.decide(long, [target], NOW + 10).admitted is admitted


def test_a_ranker_that_timed_too_few_relays_borrows_the_latest_tail_another_reported() -> None:
    policy = AdmissionPolicy(config(relay_window_wait_factor=2.0))
    policy.room.observe("ranker-1", waits(100.0), NOW - 0.3)
    policy.room.observe("ranker-2", waits(150.0), NOW - 0.2)  # the latest
    policy.room.observe(X, waits(0.0), NOW - 0.1)  # too few timed there
    assert policy.decide(event("a"), [ranker()], NOW).relay_window_ms == 300
    policy.room.observe(X, waits(50.0), NOW)  # its own, once it has one
    assert policy.decide(event("b"), [ranker()], NOW).relay_window_ms == 100
    # Stale everywhere (a relay window on): the longest window again.
    later = NOW + 2.0
    assert policy.decide(event("c"), [ranker()], later).relay_window_ms == WINDOW_MS


def test_the_fallback_order_is_the_directory_s_entry_then_the_version_s_ranking() -> None:
    mine = [ranker(f"ranker-{i}", model_version="v1") for i in range(6)]
    other = ranker("ranker-9", model_version="v2")
    cluster = MemoryCluster(clock=lambda: NOW)
    for record in [*mine, other]:
        cluster.join(record, ttl_s=10.0)
    index = VersionIndex.of(cluster.view())
    hashed = ranking("user-a", [r.instance_id for r in mine])
    plain = fallback_order("user-a", "v1", index, cluster)
    assert [r.instance_id for r in plain] == hashed  # only v1's rankers, in the user's order
    assert plain == [next(r for r in mine if r.instance_id == i) for i in hashed]
    # The user's live entry under v1 goes first; an entry under v2 does not count for v1.
    cluster.put(PlacementRecord("user-a", hashed[-1], NOW + 5, "v1"), hashed[-1])
    cluster.put(PlacementRecord("user-a", other.instance_id, NOW + 5, "v2"), other.instance_id)
    placed = fallback_order("user-a", "v1", index, cluster)
    assert [r.instance_id for r in placed] == [hashed[-1], *hashed[:-1]]
    assert fallback_order("user-a", "v3", index, cluster) == []  # no ranker serves it
