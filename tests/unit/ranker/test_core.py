"""RankerCore fed events, its actions checked: one test per cache outcome, the peer fetch and its
fallbacks, the drain's order, single flight. No model, no thread, no loop: a step's product is
the prefix's size, and the clock stands still unless a test moves it."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pytest

from relaygr.behaviours import UserId
from relaygr.cost import CostModel
from relaygr.errors import DeadlineExceeded, Unavailable
from services.ranker.core import RankerCore
from services.ranker.core_types import (
    Action,
    Answer,
    CoreSettings,
    Extend,
    FullForward,
    Kept,
    Observation,
    Prefill,
    PreInferAnswer,
    RankAnswer,
    Reload,
    RequestId,
    RunBatch,
    RunStep,
    Score,
    StartFetch,
    Waited,
    chunk_span,
)
from services.ranker.digest import ModelVersion, PrefixDigest
from services.ranker.flight import FlightState
from services.ranker.kv_store import CacheKey, KVStore, Tier
from services.ranker.outcomes import CacheOutcome, PreInferOutcome
from services.ranker.plan import Held
from services.ranker.queues import Job, Priority

BYTES_PER_TOKEN = 100
USER_FEATURES = 4
COST = CostModel(
    fixed_ms=1.0, per_token_ms=0.01, per_pair_ms=1e-6, per_candidate_key_ms=1e-5,
    reload_ms_per_mb=0.01,
)  # fmt: skip
SETTINGS = CoreSettings(relay_enabled=True, relay_window_s=30.0, prefill_chunk_tokens=64)


@dataclass(frozen=True, slots=True)
class KV:
    behaviours: int
    tokens: int
    nbytes: int
    on_device: bool = True


def held(kv: KV) -> Held:
    return Held(kv.behaviours, kv.tokens, kv.nbytes, kv.on_device)


@dataclass(frozen=True, slots=True)
class P:
    """A prefix: its user and its behaviours' ids (the digest of a head is that of its ids)."""

    user: str
    items: tuple[int, ...]

    @property
    def user_id(self) -> UserId:
        return UserId(self.user)

    @property
    def digest(self) -> PrefixDigest:
        return self.head_digest(len(self.items))

    @property
    def user_features(self) -> int:
        return USER_FEATURES

    @property
    def behaviours(self) -> int:
        return len(self.items)

    def head_digest(self, behaviours: int) -> PrefixDigest:
        return PrefixDigest(",".join(map(str, self.items[:behaviours])))


@dataclass(frozen=True, slots=True)
class R:
    prefix: P
    short_term: int = 8
    candidates: int = 16


def size(p: P) -> KV:
    tokens = USER_FEATURES + p.behaviours
    return KV(p.behaviours, tokens, tokens * BYTES_PER_TOKEN)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Peers:
    """Peers that may hold a key, and a transfer cost per byte."""

    def __init__(self, names: Sequence[str], ms: float) -> None:
        self.names, self.ms = list(names), ms

    def peers(self, key: CacheKey) -> list[str]:
        return list(self.names)

    def transfer_ms(self, nbytes: int) -> float:
        return self.ms


class Driver:
    """Carries out the core's actions at once (a step's product: its prefix's size)."""

    def __init__(self, core: RankerCore[KV]) -> None:
        self.core = core
        self.log: list[Action] = []
        self.answers: dict[RequestId, Answer] = {}
        self.running: list[Job] = []  # the running call's jobs (a step, or a batch)
        self.fetches: list[StartFetch] = []

    def feed(self, actions: list[Action]) -> None:
        for action in actions:
            self.log.append(action)
            if isinstance(action, Answer):
                self.answers[action.request] = action
            elif isinstance(action, RunStep):
                self.running = [action.job]
            elif isinstance(action, RunBatch):
                self.running = list(action.jobs)
            elif isinstance(action, StartFetch):
                self.fetches.append(action)

    def pre_infer(self, p: P, **kw: object) -> RequestId:
        rid, actions = self.core.pre_infer(p, None, None, **kw)  # type: ignore[arg-type]
        self.feed(actions)
        return rid

    def rank(self, r: R, deadline: float | None = None) -> RequestId:
        rid, actions = self.core.rank(r, deadline)
        self.feed(actions)
        return rid

    def call(self) -> list[Job]:
        """Start the next call if the worker is free, and finish it: its jobs ([]: none)."""
        if not self.running:
            self.feed(self.core.worker_free())
        jobs, self.running = self.running, []
        for job in jobs:
            self.feed(self.core.step_done(job, product(job)))
        return jobs

    def step(self) -> Job | None:
        """`call`, its first job (None: nothing ran)."""
        jobs = self.call()
        return jobs[0] if jobs else None

    def run(self) -> list[Job]:
        """Every call until the queues are empty: their jobs, in order."""
        ran = []
        while jobs := self.call():
            ran += jobs
        return ran

    def result(self, rid: RequestId) -> PreInferAnswer | RankAnswer:
        answer = self.answers[rid]
        assert answer.error is None, answer.error
        assert answer.result is not None
        return answer.result


def product(job: Job) -> object:
    spec = job.spec
    if isinstance(spec, Prefill | Extend):
        return size(spec.prefix)
    if isinstance(spec, Reload):
        return replace(spec.host, on_device=True)
    if isinstance(spec, FullForward) and spec.keep:
        return Kept("scores", size(spec.request.prefix))
    return "scores"


def make(
    hbm_prefixes: float = 4.0,
    relay: bool = True,
    cost: CostModel = COST,
    peers: Peers | None = None,
    prefix_behaviours: int = 100,
    settings: CoreSettings = SETTINGS,
    observe: Callable[[Observation], None] | None = None,
) -> tuple[RankerCore[KV], Driver, Clock]:
    clock = Clock()
    one = (USER_FEATURES + prefix_behaviours) * BYTES_PER_TOKEN
    store: KVStore[KV] = KVStore(
        int(hbm_prefixes * one), 8 * one, 600.0, clock, lambda kv: replace(kv, on_device=False)
    )
    settings = replace(settings, relay_enabled=relay)
    core = RankerCore(
        store, cost, settings, ModelVersion("v"), BYTES_PER_TOKEN, held, clock, observe, peers
    )
    return core, Driver(core), clock


def prefix(user: str, n: int = 100, start: int = 0) -> P:
    return P(user, tuple(range(start, start + n)))


def specs(driver: Driver) -> list[type]:
    return [type(a.job.spec) for a in driver.log if isinstance(a, RunStep)]


# -- one test per cache outcome ----------------------------------------------------------------


def test_hbm_hit_scores_against_the_pinned_relay_at_rank_priority() -> None:
    core, d, _ = make()
    a = prefix("a")
    pre = d.pre_infer(a)
    d.run()
    assert d.result(pre) == PreInferAnswer(
        PreInferOutcome.COMPUTED, core.key(a), 104, 104 * BYTES_PER_TOKEN
    )
    rank = d.rank(R(a))
    [score] = [a for a in d.log if isinstance(a, RunStep) and isinstance(a.job.spec, Score)] or [
        None
    ]
    assert score is None  # queued, not taken: the worker is asked for it next
    [job] = d.run()
    assert isinstance(job.spec, Score) and job.priority is Priority.RANK
    result = d.result(rank)
    assert isinstance(result, RankAnswer)
    assert (result.outcome, result.computed_tokens, result.relayed) == (
        CacheOutcome.HBM_HIT, 8 + 16, True,
    )  # fmt: skip
    entry = core.store.peek(core.key(a), Tier.HBM)
    assert entry is not None and not entry.pinned  # consumed


def test_dram_hit_reloads_the_host_copy() -> None:
    core, d, _ = make(hbm_prefixes=1.5)
    a, b = prefix("a"), prefix("b")
    d.pre_infer(a)
    d.run()
    d.rank(R(a))
    d.run()
    d.pre_infer(b)
    d.run()
    assert core.store.tier_of(core.key(a)) is Tier.DRAM
    rank = d.rank(R(a))
    ran = d.run()
    assert [type(j.spec) for j in ran] == [Reload, Score]
    result = d.result(rank)
    assert isinstance(result, RankAnswer)
    assert (result.outcome, result.computed_tokens) == (CacheOutcome.DRAM_HIT, 24)


def test_a_rank_behind_its_queued_pre_infer_waits_and_promotes_it() -> None:
    core, d, _ = make(cost=replace(COST, fixed_ms=0.0))  # chunks cost no more than one call
    a = prefix("a")
    pre = d.pre_infer(a)
    rank = d.rank(R(a))
    assert core.waiting(rank)
    assert [e.kind for e in core.queues.events].count("promoted") == 1
    [flight] = core.flights.values()
    assert flight.job is not None and flight.job.priority is Priority.RANK
    d.run()
    assert Waited(rank) in d.log
    result = d.result(rank)
    assert isinstance(result, RankAnswer)
    assert (result.outcome, result.relayed) == (CacheOutcome.WAITED_INFLIGHT, True)
    assert d.result(pre).outcome is PreInferOutcome.COMPUTED  # type: ignore[union-attr]
    assert specs(d).count(Prefill) == 2  # 104 tokens in 64-token chunks: one job, two steps


def test_a_longer_prefix_extends_the_cached_one() -> None:
    _core, d, _ = make()
    short, long = prefix("e", 100), prefix("e", 140)
    d.pre_infer(short)
    d.run()
    rank = d.rank(R(long))
    ran = d.run()
    assert isinstance(ran[0].spec, Extend) and ran[0].spec.base_behaviours == 100
    result = d.result(rank)
    assert isinstance(result, RankAnswer)
    assert (result.outcome, result.computed_tokens) == (CacheOutcome.EXTENDED, 40 + 24)


def test_a_cached_prefix_that_does_not_start_the_new_history_is_not_extended() -> None:
    _core, d, _ = make()
    d.pre_infer(prefix("e", 100, start=0))
    d.run()
    other = prefix("e", 140, start=1)  # longer, but its first 100 behaviours differ
    rank = d.rank(R(other))
    ran = d.run()
    assert [(type(j.spec), j.spec.keep) for j in ran] == [(FullForward, True)]  # type: ignore[union-attr]
    assert d.result(rank).outcome is CacheOutcome.MISS  # type: ignore[union-attr]


def test_a_miss_computes_the_prefix_in_one_call_and_keeps_it() -> None:
    _core, d, _ = make()
    a = prefix("m")
    first = d.rank(R(a))
    ran = d.run()
    # Its full inference, keeping the prefix: one call's overhead, not a prefill's and a rank's.
    [job] = ran
    assert isinstance(job.spec, FullForward) and job.spec.keep
    assert job.priority is Priority.RANK and len(job.step_ms) == 1
    assert job.step_ms[0] == pytest.approx(COST.full_ms(104 + 8, 16))
    result = d.result(first)
    assert isinstance(result, RankAnswer)
    assert (result.outcome, result.computed_tokens) == (CacheOutcome.MISS, 104 + 24)
    assert result.scores == "scores"
    again = d.rank(R(a))
    d.run()
    assert d.result(again).outcome is CacheOutcome.HBM_HIT  # type: ignore[union-attr]


def test_bypass_runs_full_inference_and_refuses_pre_inference() -> None:
    core, d, _ = make(relay=False)
    a = prefix("x")
    pre = d.pre_infer(a)
    assert isinstance(d.answers[pre].error, Unavailable)
    rank = d.rank(R(a))
    ran = d.run()
    assert [type(j.spec) for j in ran] == [FullForward]
    assert ran[0].priority is Priority.RANK
    result = d.result(rank)
    assert isinstance(result, RankAnswer)
    assert (result.outcome, result.computed_tokens) == (CacheOutcome.BYPASS, 104 + 8 + 16)
    assert core.store.usage(Tier.HBM).entries == 0


# -- peer fetch --------------------------------------------------------------------------------


def test_a_miss_a_peer_holds_is_fetched_when_sooner() -> None:
    core, d, _ = make(peers=Peers(["old"], ms=0.01))
    a = prefix("moved")
    rank = d.rank(R(a))
    [fetch] = d.fetches
    assert (fetch.key, fetch.peers, fetch.nbytes) == (core.key(a), ("old",), 104 * BYTES_PER_TOKEN)
    assert core.flights[core.key(a)].state is FlightState.FETCHING
    d.feed(core.fetch_done(core.key(a), size(a)))
    assert specs(d) == []  # nothing computed the prefix
    d.run()
    result = d.result(rank)
    assert isinstance(result, RankAnswer)
    assert (result.outcome, result.computed_tokens) == (CacheOutcome.PEER_FETCHED, 24)


def test_a_dear_transfer_is_not_fetched() -> None:
    _core, d, _ = make(peers=Peers(["old"], ms=1e6))
    d.rank(R(prefix("moved")))
    assert d.fetches == [] and [type(j.spec) for j in d.run()] == [FullForward]


@pytest.mark.parametrize("waiting_ranks", [0, 2])
def test_a_failed_or_timed_out_fetch_falls_back_to_computing(waiting_ranks: int) -> None:
    core, d, clock = make(peers=Peers(["old"], ms=0.01))
    a = prefix("moved")
    pre = d.pre_infer(a)
    key = core.key(a)
    assert core.fetch_deadline(key) is None
    ranks = [d.rank(R(a), deadline=clock.now + 5.0 - i) for i in range(waiting_ranks)]
    if ranks:  # the waiting Ranks lift the fallback: rank priority, the earliest deadline
        assert core.fetch_deadline(key) == clock.now + 4.0
    clock.now += 1.0  # no peer delivered in time (a timeout ends the fetch like a miss)
    d.feed(core.fetch_done(key, None))
    flight = core.flights[key]
    assert flight.state is FlightState.COMPUTING and flight.job is not None
    expected = Priority.RANK if ranks else Priority.BACKGROUND
    assert flight.job.priority is expected
    d.run()
    assert d.result(pre).outcome is PreInferOutcome.COMPUTED  # type: ignore[union-attr]
    for rank in ranks:
        assert d.result(rank).outcome is CacheOutcome.WAITED_INFLIGHT  # type: ignore[union-attr]


def test_a_job_not_started_by_its_deadline_never_runs() -> None:
    core, d, clock = make()
    a = prefix("a")
    rid, actions = core.pre_infer(a, None, clock.now + 1.0)
    d.feed(actions)
    clock.now += 2.0  # the PreInfer's deadline passed before its job started
    assert d.run() == []
    assert isinstance(d.answers[rid].error, DeadlineExceeded)
    assert core.inflight() == 0 and [e.kind for e in core.queues.events][-1] == "expired"
    rank = d.rank(R(a))  # the prefix was never made: a miss computes it
    d.run()
    assert d.result(rank).outcome is CacheOutcome.MISS  # type: ignore[union-attr]


# -- single flight, drain ----------------------------------------------------------------------


def test_one_prefix_is_computed_once_however_many_ask() -> None:
    core, d, _ = make()
    a = prefix("a")
    pres = [d.pre_infer(a) for _ in range(3)]
    ranks = [d.rank(R(a)) for _ in range(3)]
    assert core.inflight() == 1
    ran = d.run()
    # The first Rank restarts the queued prefill as its own full inference, keeping the prefix;
    # the others score on it.
    assert [type(j.spec) for j in ran] == [FullForward, Score, Score]
    outcomes = [d.result(r).outcome for r in pres + ranks]
    assert outcomes.count(PreInferOutcome.COMPUTED) + outcomes.count(CacheOutcome.MISS) == 1


def test_drain_refuses_pre_inference_and_orders_the_hand_off_by_value() -> None:
    core, d, _clock = make(hbm_prefixes=3.0)
    a, b, c, e = (prefix(u) for u in "abce")
    for p in (a, b):
        _rid, actions = core.pre_infer(p, 10.0 if p is a else 5.0, None)
        d.feed(actions)
    d.rank(R(c))  # a miss: unpinned on the device, used last
    d.run()
    d.rank(R(e))  # pushes the least recently used unpinned entry to the host
    d.run()
    d.feed(core.drain())
    refused = d.pre_infer(prefix("z"))
    assert isinstance(d.answers[refused].error, Unavailable)
    order = [(x.key.user_id, x.tier) for x in core.handoff_order()]
    # pinned first, by earliest pin end; then unpinned device entries, most recent first; then
    # the host tier
    assert order == [("b", Tier.HBM), ("a", Tier.HBM), ("e", Tier.HBM), ("c", Tier.DRAM)]


def test_a_refitted_cost_model_decides_from_then_on() -> None:
    core, d, _ = make(hbm_prefixes=1.5)
    a, b = prefix("a"), prefix("b")
    d.rank(R(a))
    d.run()
    d.pre_infer(b)
    d.run()
    core.cost_model_refitted(replace(COST, reload_ms_per_mb=1e9))  # reloading is now dear
    d.rank(R(a))
    assert [type(j.spec) for j in d.run()] == [FullForward]


def test_background_chunks_grow_to_a_bounded_call_cost_share_by_the_model_in_use() -> None:
    """A call costs `COST.fixed_ms` beside 0.01 ms a token: 300 tokens make the fixed cost a
    quarter of the call, so at a share of 0.25 the 64-token chunk grows to 320 (a 1,004-token
    prefix: four calls, not sixteen). A refit that makes tokens dear brings it back to 64."""
    settings = replace(SETTINGS, prefill_chunk_fixed_share=0.25)
    core, d, _ = make(prefix_behaviours=1000, settings=settings)
    d.pre_infer(prefix("a", 1000))
    assert _spans(d) == [(0, 320), (320, 640), (640, 960), (960, 1004)]
    core.cost_model_refitted(replace(COST, per_token_ms=0.1))  # 30 tokens would do
    d.pre_infer(prefix("b", 1000))
    assert len(_spans(d)) == 16


def _spans(d: Driver) -> list[tuple[int, int] | None]:
    """What each call computes as it starts (`chunk_span`), until the queues are empty."""
    spans = []
    while True:
        if not d.running:
            d.feed(d.core.worker_free())
        if not d.running:
            return spans
        [job] = d.running
        spans.append(chunk_span(job.spec, job.steps_run))
        d.running = []
        d.feed(d.core.step_done(job, product(job)))


def test_reading_the_stats_changes_nothing_and_a_tick_expires_relays() -> None:
    core, d, clock = make()
    _rid, actions = core.pre_infer(prefix("a"), 1.0, None)
    d.feed(actions)
    d.run()
    clock.now += 2.0  # past the relay window
    for _ in range(2):
        stats = core.stats()
        assert stats.tiers[Tier.HBM].pinned_bytes == 104 * BYTES_PER_TOKEN
        assert stats.kv.relays_expired_unconsumed == 0
    d.feed(core.tick())
    stats = core.stats()
    assert stats.tiers[Tier.HBM].pinned_bytes == 0
    assert stats.kv.relays_expired_unconsumed == 1


# -- a miss keeps its place --------------------------------------------------------------------


def test_a_miss_is_scored_before_ranks_that_arrived_after_it() -> None:
    """A's Rank misses its device tier: its host copy is reloaded, then it is scored; B's Rank
    (a hit) arrives while A's reload runs. A's scoring, queued when the reload lands, goes
    before B's: the miss keeps the place its Rank had in line (a cache-only server that ran a
    miss as one job would score A first too)."""
    core, d, clock = make(hbm_prefixes=1.5)
    a, b = prefix("a"), prefix("b", start=1000)
    d.pre_infer(a)
    d.run()
    d.rank(R(a))
    d.run()
    d.pre_infer(b)
    d.run()  # b is pinned: its Rank is a hit; a went to the host tier
    assert core.store.tier_of(core.key(a)) is Tier.DRAM
    miss = d.rank(R(a))  # arrives first
    d.feed(core.worker_free())  # A's reload is taken
    [running] = d.running
    assert isinstance(running.spec, Reload)
    clock.now += 1.0
    hit = d.rank(R(b))  # arrives while A's reload runs: its scoring queues at once
    clock.now += 1.0
    ran = d.run()  # A's reload lands, A's scoring queues behind B's by submission
    scored = [j.name for j in ran if isinstance(j.spec, Score)]
    assert scored == ["rank", "rank"]
    first = next(j for j in ran if isinstance(j.spec, Score))
    assert first.spec.request.prefix == a, "B's later Rank overtook A's miss"
    assert isinstance(d.result(miss), RankAnswer) and isinstance(d.result(hit), RankAnswer)
    assert d.result(miss).outcome is CacheOutcome.DRAM_HIT  # type: ignore[union-attr]


def test_a_rank_waiting_for_a_background_prefill_lifts_it_into_its_own_place() -> None:
    _, d, clock = make(cost=replace(COST, fixed_ms=0.0))
    b = prefix("b", start=1000)
    d.pre_infer(b)
    d.run()
    a = prefix("a")
    d.pre_infer(a)  # background prefill of a, queued
    clock.now += 1.0
    early = d.rank(R(a))  # waits for it: promoted in this Rank's place
    clock.now += 1.0
    d.rank(R(b))  # a later hit
    ran = d.run()
    first_rank_work = next(j for j in ran if j.priority is Priority.RANK)
    assert isinstance(first_rank_work.spec, Prefill | Extend), first_rank_work
    assert first_rank_work.spec.prefix == a  # before the later hit's scoring
    assert d.result(early).outcome is CacheOutcome.WAITED_INFLIGHT  # type: ignore[union-attr]


def test_the_wait_tail_reported_is_that_of_the_ranks_that_met_their_relay() -> None:
    core, d, clock = make(hbm_prefixes=4.0)
    a = prefix("a")
    for i in range(120):
        d.pre_infer(a)  # already resident after the first: pinned again from now
        d.run()
        clock.now += 0.001 * (i % 100) if i < 100 else 0.05
        d.rank(R(a))
        d.run()
        d.rank(R(a))  # a second Rank of the same relay is not timed
        d.run()
    # 120 waits: 100 of 0-99 ms, then 20 of 50 ms; the 119th of them in order is 98 ms.
    assert core.stats().relay_wait_p99_ms == pytest.approx(98.0)
    b = prefix("b")
    d.rank(R(b))  # a miss: no relay to time
    d.run()
    assert len(core.relay_waits) == 120
