"""Trigger admission: reasons in order, token-rate budget, relay footprint books, live config."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from relaygr.cluster import RankerRecord
from relaygr.config import override_config
from relaygr.errors import ConfigError
from services.trigger.config import LIVE_FIELDS, Mode, TriggerConfig
from services.trigger.policy import AdmissionPolicy, Decision, Event, Reason, TokenBucket

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


def config(**overrides: Any) -> TriggerConfig:
    # defaults: slo 50, margin 5, window 2 s, cooldown 1 s
    return TriggerConfig(**{"plaintext": True, **overrides})


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
    return Decision(Reason.ADMITTED, predicted, X, NBYTES, PREFILL_MS, digest)


def relay(
    policy: AdmissionPolicy,
    user: str = "user-0",
    now: float = 0.0,
    digest: str = "digest-a",
    target: RankerRecord | None = None,
) -> Decision:
    """Admit a relay (asserting that it is admitted) and return its decision."""
    decision = policy.decide(event(user, digest=digest), target or ranker(), now)
    assert decision.admitted, decision
    return decision


# -- admission reasons, table-driven ------------------------------------------------------


def _nothing(policy: AdmissionPolicy, target: RankerRecord) -> None:
    pass


def _in_flight(policy: AdmissionPolicy, target: RankerRecord) -> None:
    relay(policy, target=target)


def _settled(policy: AdmissionPolicy, target: RankerRecord) -> None:
    relay(policy, target=target)
    policy.ledger.settle("user-0", "digest-a", X, NBYTES, 0.5)


def _other_user_refused(policy: AdmissionPolicy, target: RankerRecord) -> None:
    policy.refused(relay(policy, "user-1", target=target), "user-1", 0.5)  # until 1.5 > NOW


def _bucket_spent(policy: AdmissionPolicy, target: RankerRecord) -> None:
    relay(policy, "user-1", target=target)  # rate 5/s, capacity 5: 5 - 17.5 + 5 * NOW = -7.5


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


SPENT = {"prefill_share": 0.005, "burst_s": 1.0}  # 5 ms of prefill per second, 5 ms at once
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
    Case("dedup-before-load", Reason.IN_FLIGHT, cfg=SPENT, before=_in_flight),
    Case(
        "dedup-before-footprint",  # a second relay of 96,000 would not fit 100,000
        Reason.IN_FLIGHT,
        cfg={"relay_budget_share": 1.0},
        target=SMALL_HBM,
        before=_in_flight,
    ),
    Case("over-relay-budget", Reason.FOOTPRINT_LIMIT, target=SMALL_HBM),
    Case("target-refused-recently", Reason.FOOTPRINT_LIMIT, before=_other_user_refused),
    Case("bucket-spent", Reason.LOAD_LIMIT, cfg=SPENT, before=_bucket_spent),
    Case(
        "footprint-before-load",
        Reason.FOOTPRINT_LIMIT,
        cfg=SPENT,
        before=lambda p, t: _bucket_spent(p, ranker()),
        target=SMALL_HBM,
    ),
    Case("all-not-at-risk", Reason.ADMITTED, mode=Mode.ALL, candidates=SAFE),
    Case("all-over-relay-budget", Reason.ADMITTED, mode=Mode.ALL, target=SMALL_HBM),
    Case("all-after-refusal", Reason.ADMITTED, mode=Mode.ALL, before=_other_user_refused),
    Case("all-tiny-budget", Reason.ADMITTED, mode=Mode.ALL, cfg=SPENT, before=_bucket_spent),
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
    decision = policy.decide(ev, target if case.has_target else None, NOW)

    predicted = PREDICTED[case.candidates]
    if case.reason in (Reason.RELAY_DISABLED, Reason.NO_RANKER):
        assert decision == Decision(case.reason)
        assert digest.calls == 0  # no hashing for events that can never be relayed
    elif case.reason is Reason.NOT_AT_RISK:
        assert decision == Decision(case.reason, predicted, X)
        assert digest.calls == 0
    else:
        assert decision == Decision(case.reason, predicted, X, NBYTES, PREFILL_MS, case.digest)
        assert digest.calls == 1
    assert decision.admitted is (case.reason is Reason.ADMITTED)


def test_at_risk_boundary_is_exact_both_sides() -> None:
    policy = AdmissionPolicy(config())
    assert policy.decide(event("a", candidates=SAFE), ranker(), NOW).reason is Reason.NOT_AT_RISK
    assert policy.decide(event("b", candidates=AT_RISK), ranker(), NOW) == admitted()
    # The same 45.625 prediction against a threshold moved by the margin, either side of it.
    policy.reconfigure(config(margin_ms=4.375))  # 50 - 4.375 = 45.625: within, not at risk
    decision = policy.decide(event("c"), ranker(), NOW)
    assert decision == Decision(Reason.NOT_AT_RISK, 45.625, X)
    policy.reconfigure(config(margin_ms=4.5))  # 45.5 < 45.625
    assert policy.decide(event("c"), ranker(), NOW).admitted


def test_prediction_uses_prefix_plus_short_term_and_prefill_only_the_prefix() -> None:
    # history 100 + 28 = 128 tokens as before; prefill and bytes follow the 100 prefix tokens.
    ev = event(prefix=100, short_term=28)
    decision = AdmissionPolicy(config()).decide(ev, ranker(kv_bytes_per_token=3), NOW)
    prefill = 1 + 100 / 8 + 100 * 100 / 2048
    assert decision == Decision(Reason.ADMITTED, 45.625, X, 300, prefill, "digest-a")


def test_already_cached_until_settle_plus_window_then_admitted_again() -> None:
    policy = AdmissionPolicy(config())  # window 2 s
    relay(policy, now=0.0)
    assert policy.decide(event(), ranker(), 1.9).reason is Reason.IN_FLIGHT
    policy.ledger.settle("user-0", "digest-a", X, NBYTES, 1.0)  # resident until 3.0
    assert policy.decide(event(), ranker(), 2.999).reason is Reason.ALREADY_CACHED
    assert policy.decide(event(), ranker(), 3.0) == admitted()


def test_in_flight_relay_that_never_settles_lapses_after_one_window() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    assert policy.decide(event(), ranker(), 1.999).reason is Reason.IN_FLIGHT
    assert policy.decide(event(), ranker(), 2.0).admitted


@pytest.mark.parametrize(
    ("pinned", "reason"), [(104_000, Reason.ADMITTED), (104_001, Reason.FOOTPRINT_LIMIT)]
)
def test_footprint_boundary_is_exact(pinned: int, reason: Reason) -> None:
    # relay budget 400,000 * 0.5 = 200,000 = observed 104,000 + 96,000 exactly
    policy = AdmissionPolicy(config(relay_budget_share=0.5))
    target = ranker(hbm_budget_bytes=400_000)
    policy.ledger.observe(X, pinned, NOW)
    decision = policy.decide(event(), target, NOW)
    assert decision.reason is reason
    assert decision.kv_bytes == NBYTES and decision.digest == "digest-a"


def test_footprint_counts_this_triggers_relays_on_the_same_target_only() -> None:
    policy = AdmissionPolicy(config(relay_budget_share=0.5))
    target = ranker(hbm_budget_bytes=400_000)  # 200,000: room for two relays of 96,000
    relay(policy, "a", target=target)
    relay(policy, "b", target=target)
    assert policy.decide(event("c"), target, 0.0).reason is Reason.FOOTPRINT_LIMIT
    other = ranker("ranker-1", hbm_budget_bytes=400_000)
    assert policy.decide(event("c"), other, 0.0).admitted


def test_refusal_blocks_the_target_until_the_cooldown_passes() -> None:
    policy = AdmissionPolicy(config(refusal_cooldown_ms=1000))
    decision = relay(policy, "a", now=10.0)
    policy.refused(decision, "a", 10.0)  # refused until 11.0
    assert policy.ledger.held(X, 10.0) == 0  # the refused relay holds nothing
    assert policy.decide(event("a"), ranker(), 10.0).reason is Reason.FOOTPRINT_LIMIT  # no dedup
    assert policy.decide(event("b"), ranker(), 10.999).reason is Reason.FOOTPRINT_LIMIT
    assert policy.decide(event("c", candidates=SAFE), ranker(), 10.5).reason is (Reason.NOT_AT_RISK)
    assert policy.decide(event("d"), ranker("ranker-1"), 10.5).admitted  # other targets are fine
    assert policy.decide(event("b"), ranker(), 11.0).admitted


def test_an_observation_clears_a_refusal() -> None:
    policy = AdmissionPolicy(config(refusal_cooldown_ms=1000))
    policy.refused(relay(policy, "a", now=10.0), "a", 10.0)
    assert policy.decide(event("b"), ranker(), 10.2).reason is Reason.FOOTPRINT_LIMIT
    policy.ledger.observe(X, 0, 10.3)
    assert policy.decide(event("b"), ranker(), 10.4).admitted


def test_an_observation_sent_before_the_refusal_does_not_clear_it() -> None:
    policy = AdmissionPolicy(config(refusal_cooldown_ms=1000))
    policy.refused(relay(policy, "a", now=10.0), "a", 10.0)
    policy.ledger.observe(X, 0, 9.9)  # a Describe already in flight when the ranker refused
    assert policy.decide(event("b"), ranker(), 10.4).reason is Reason.FOOTPRINT_LIMIT


def test_a_late_answer_to_an_older_observation_is_ignored() -> None:
    ledger = AdmissionPolicy(config()).ledger
    ledger.observe(X, 7000, 2.0)
    ledger.observe(X, 5000, 1.0)
    assert ledger.held(X, 2.5) == 7000


def test_sweep_forgets_the_buckets_of_departed_rankers() -> None:
    policy = AdmissionPolicy(config(prefill_share=0.01, burst_s=1.0))
    relay(policy, "a", now=0.0)  # spends ranker-0's bucket
    assert policy.decide(event("b"), ranker(), 0.0).reason is Reason.LOAD_LIMIT
    policy.sweep(0.0, {})
    assert policy.decide(event("b"), ranker(), 0.0).admitted  # a ranker that returns starts full


def test_load_limit_until_the_bucket_refills_per_target() -> None:
    policy = AdmissionPolicy(config(prefill_share=0.01, burst_s=1.0))  # 10 ms/s, 10 ms at once
    relay(policy, "a", now=0.0)  # a full bucket admits one prefill larger than it: 10 - 17.5
    assert policy.decide(event("b"), ranker(), 0.0).reason is Reason.LOAD_LIMIT
    assert policy.decide(event("b"), ranker(), 0.75).reason is Reason.LOAD_LIMIT  # level 0.0
    assert policy.decide(event("c"), ranker("ranker-1"), 0.75).admitted  # its own bucket
    assert policy.decide(event("b"), ranker(), 1.0).admitted  # level 2.5 > 0


# -- token-rate budget ---------------------------------------------------------------------


def assert_within_budget(
    times: Sequence[float], amounts: Sequence[float], rate: float, capacity: float
) -> None:
    """Over every [t_i, t_j] the amounts taken sum to <= capacity + rate*T + their largest."""
    t, p = np.asarray(times), np.asarray(amounts)
    assert np.all(np.diff(t) >= 0)
    sums = np.concatenate(([0.0], np.cumsum(p)))
    for i in range(len(p)):
        taken = sums[i + 1 :] - sums[i]
        allowed = capacity + rate * (t[i:] - t[i]) + np.maximum.accumulate(p[i:])
        worst = int(np.argmax(taken - allowed))
        assert taken[worst] <= allowed[worst] + 1e-6, (t[i], t[i + worst])


def test_token_bucket_takes_while_positive_and_refills_up_to_capacity() -> None:
    bucket = TokenBucket(rate=100.0, capacity=100.0, now=0.0)
    assert bucket.level(0.0) == 100.0
    assert bucket.take(250.0, 0.0)  # larger than the capacity, yet taken from a full bucket
    assert bucket.level(0.0) == -150.0
    assert not bucket.take(1.0, 1.5)  # level exactly 0.0
    assert bucket.level(1.5) == 0.0  # a refused take takes nothing
    assert bucket.take(1.0, 1.75)  # 25.0 > 0
    assert bucket.level(1.0) == 24.0  # time going back refills nothing
    assert bucket.level(100.0) == 100.0  # capped


def test_token_bucket_random_takes_stay_within_the_interval_bound(rng: np.random.Generator) -> None:
    rate, capacity = 200.0, 50.0
    bucket = TokenBucket(rate, capacity, now=0.0)
    times = np.sort(rng.uniform(0.0, 10.0, size=2000))
    times[rng.integers(1, len(times), size=100)] = times[rng.integers(0, len(times), 100)]
    times = np.sort(times)  # with ties: several takes at one instant
    amounts = rng.uniform(0.1, 3 * capacity, size=len(times))  # some larger than capacity
    taken = [(t, a) for t, a in zip(times, amounts, strict=True) if bucket.take(a, t)]
    assert any(a > capacity for _, a in taken)
    assert_within_budget([t for t, _ in taken], [a for _, a in taken], rate, capacity)
    total = sum(a for _, a in taken)
    assert total >= 0.95 * rate * (times[-1] - times[0])  # saturated: the budget is used


def test_burst_of_at_risk_events_stays_within_each_targets_prefill_budget(
    rng: np.random.Generator,
) -> None:
    """1,500 at-risk events of distinct users over 10 s on 3 rankers: ~12x the prefill budget."""
    cfg = config(prefill_share=0.25, burst_s=0.5, relay_window_ms=500)
    rate, capacity = cfg.prefill_share * 1000, cfg.prefill_share * 1000 * cfg.burst_s
    # prefill = prefix / 4 ms exactly; full inference >= (prefix + 200) / 4 > 45: all at risk
    targets = [
        ranker(f"ranker-{i}", fixed_ms=0.0, per_token_ms=0.25, per_pair_ms=0.0,
               per_candidate_key_ms=0.0, kv_bytes_per_token=1, hbm_budget_bytes=10**12)
        for i in range(3)
    ]  # fmt: skip
    members = {t.instance_id: t for t in targets}
    policy = AdmissionPolicy(cfg)
    times = np.sort(rng.uniform(0.0, 10.0, size=1500))
    which = rng.integers(0, len(targets), size=len(times))
    prefixes = rng.integers(20, 241, size=len(times))  # 5 .. 60 ms of prefill
    booked: dict[str, list[tuple[float, float]]] = {i: [] for i in members}
    first: dict[str, float] = {}
    for n, (now, k, prefix) in enumerate(zip(times, which, prefixes, strict=True)):
        target = targets[k]
        first.setdefault(target.instance_id, float(now))
        ev = event(f"user-{n}", digest=f"d-{n}", prefix=int(prefix), short_term=200)
        decision = policy.decide(ev, target, float(now))
        assert decision.reason in (Reason.ADMITTED, Reason.LOAD_LIMIT)
        assert decision.prefill_ms == prefix / 4
        if decision.admitted:
            booked[target.instance_id].append((float(now), decision.prefill_ms))
        if n % 100 == 0:
            policy.ledger.sweep(float(now), members)
    for instance, admissions in booked.items():
        assert_within_budget([t for t, _ in admissions], [p for _, p in admissions], rate, capacity)
        total, span = sum(p for _, p in admissions), times[-1] - first[instance]
        assert 0.95 * rate * span <= total <= capacity + rate * span + 60.0


# -- footprint books -----------------------------------------------------------------------


def test_bytes_held_from_admission_until_an_observation_after_settle_shows_them_gone() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    ledger = policy.ledger
    assert ledger.held(X, 0.0) == NBYTES
    assert ledger.held("ranker-1", 0.0) == 0
    ledger.settle("user-0", "digest-a", X, NBYTES, 0.5)
    assert ledger.held(X, 0.5) == NBYTES
    ledger.observe(X, 0, 0.4)  # sent before the settle: may predate the pin
    assert ledger.held(X, 0.6) == NBYTES
    ledger.observe(X, 0, 0.5)  # sent at the settle: the Rank consumed it
    assert ledger.held(X, 0.6) == 0
    assert policy.decide(event(), ranker(), 0.6).reason is Reason.ALREADY_CACHED


def test_a_covered_relay_still_pinned_is_counted_once() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    policy.ledger.settle("user-0", "digest-a", X, NBYTES, 0.5)
    policy.ledger.observe(X, NBYTES + 1000, 0.7)  # its pin and another of 1,000 bytes
    assert policy.ledger.held(X, 0.8) == NBYTES + 1000


def test_settle_records_where_the_relay_landed_and_its_size() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    policy.ledger.settle("user-0", "digest-a", "ranker-1", 5000, 0.5)
    assert (policy.ledger.held(X, 0.5), policy.ledger.held("ranker-1", 0.5)) == (0, 5000)
    policy.ledger.settle("user-0", "digest-old", X, 7000, 0.6)  # not this relay: ignored
    assert policy.ledger.held("ranker-1", 0.6) == 5000


def test_unobserved_relay_is_released_when_it_expires() -> None:
    policy = AdmissionPolicy(config())  # window 2 s
    relay(policy, now=0.0)
    policy.ledger.settle("user-0", "digest-a", X, NBYTES, 0.5)
    assert policy.ledger.held(X, 2.499) == NBYTES
    assert policy.ledger.held(X, 2.5) == 0


def test_an_observation_counts_for_one_window_after_it_was_taken() -> None:
    ledger = AdmissionPolicy(config()).ledger
    ledger.observe(X, 5000, 1.0)
    assert [ledger.held(X, t) for t in (1.0, 2.999, 3.0)] == [5000, 5000, 0]
    ledger.observe(X, 7000, 2.0)  # the latest observation replaces the earlier one
    assert ledger.held(X, 2.5) == 7000


def test_fail_returns_the_bytes_of_that_relay_only() -> None:
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0)
    policy.ledger.fail("user-0", "digest-other")
    assert policy.ledger.held(X, 0.0) == NBYTES
    policy.ledger.fail("user-0", "digest-a")
    assert policy.ledger.held(X, 0.0) == 0
    assert policy.decide(event(), ranker(), 0.0).admitted  # nothing left to deduplicate


def test_sweep_drops_expired_relays_and_departed_instances() -> None:
    policy = AdmissionPolicy(config())
    ledger = policy.ledger
    relay(policy, "old", now=0.0)  # expires at 2.0
    relay(policy, "new", now=1.0)  # expires at 3.0
    ledger.observe(X, 10, 1.0)
    ledger.observe("ranker-1", 20, 1.0)
    relay(policy, "elsewhere", now=1.0)
    ledger.settle("elsewhere", "digest-a", "ranker-1", NBYTES, 1.0)
    ledger.refuse(X, 1.0, 5.0)
    ledger.refuse("ranker-1", 1.0, 5.0)
    ledger.sweep(2.0, {X: ranker()})
    assert set(ledger.relays) == {("new", "digest-a")}  # not expired, nor on a departed ranker
    assert set(ledger.observed) == {X}
    assert set(ledger.refusals) == {X}
    assert ledger.held(X, 2.0) == 10 + NBYTES


def test_reconfigure_applies_a_new_window() -> None:
    policy = AdmissionPolicy(config())
    policy.reconfigure(config(relay_window_ms=500))
    relay(policy, now=0.0)  # in flight until 0.5
    assert policy.decide(event(), ranker(), 0.499).reason is Reason.IN_FLIGHT
    assert policy.ledger.held(X, 0.5) == 0
    relay(policy, "b", now=1.0)
    policy.ledger.settle("b", "digest-a", X, NBYTES, 1.0)
    assert [policy.ledger.held(X, t) for t in (1.499, 1.5)] == [NBYTES, 0]
    policy.ledger.observe(X, 42, 2.0)
    assert [policy.ledger.held(X, t) for t in (2.499, 2.5)] == [42, 0]


def test_reconfigure_reshapes_existing_buckets() -> None:
    policy = AdmissionPolicy(config(prefill_share=0.01, burst_s=1.0))  # 10 ms/s
    relay(policy, "a", now=0.0)  # level -7.5
    assert policy.decide(event("b"), ranker(), 0.1).reason is Reason.LOAD_LIMIT  # -6.5
    policy.reconfigure(config(prefill_share=0.5, burst_s=2.0))  # 500 ms/s, 1,000 at once
    assert policy.decide(event("b"), ranker(), 0.2).admitted  # -6.5 + 50 > 0
    # Shrinking the capacity caps a full bucket: one more prefill, then nothing.
    policy.reconfigure(config(prefill_share=0.01, burst_s=1.0))
    assert policy.decide(event("c"), ranker(), 100.0).admitted  # min(10, ...) - 17.5
    assert policy.decide(event("d"), ranker(), 100.0).reason is Reason.LOAD_LIMIT


def test_a_users_new_relay_keeps_the_pinned_bytes_of_the_previous_one() -> None:
    # RelayLedger: "A relay's bytes are released when it fails, expires, or is covered."
    policy = AdmissionPolicy(config())
    relay(policy, now=0.0, digest="digest-a")
    policy.ledger.settle("user-0", "digest-a", X, NBYTES, 0.1)
    relay(policy, now=0.2, digest="digest-b")
    assert policy.ledger.held(X, 0.2) == 2 * NBYTES


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
    assert policy.decide(event(), ranker(), NOW).reason is Reason.RELAY_DISABLED


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
