"""RankerEngine driven directly (no server): every cache outcome scores exactly as full inference,
reload is chosen over recompute only when cheaper, and one prefix is computed once however many
requests ask for it at the same time."""

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
import torch

from relaygr.behaviours import RankInput
from relaygr.cost import CostModel
from relaygr.errors import Unavailable
from services.ranker.core_types import ScoringCall
from services.ranker.engine import (
    CacheOutcome,
    EngineSettings,
    Executor,
    PreInferOutcome,
    PreInferResult,
    RankerEngine,
    RankResult,
)
from services.ranker.kv_store import KVStore, Tier
from services.ranker.model import RankingModel
from services.ranker.observer import NoopObserver, Work
from services.ranker.prefix_kv import PrefixKV
from services.ranker.queues import Job
from tests.polling import eventually
from tests.unit.ranker.factories import longer, prefix, rank_input, tiny_config

# Reloading a host copy is far cheaper than recomputing it (the shape of every real device).
CHEAP_RELOAD = CostModel(
    fixed_ms=1.0, per_token_ms=0.01, per_pair_ms=1e-6, per_candidate_key_ms=1e-5,
    reload_ms_per_mb=0.01,
)  # fmt: skip
DEAR_RELOAD = CostModel(
    fixed_ms=1.0, per_token_ms=0.01, per_pair_ms=1e-6, per_candidate_key_ms=1e-5,
    reload_ms_per_mb=1e6,
)  # fmt: skip
# No cost per model call: a prefill in chunks costs what it costs in one call, so a Rank that
# finds its prefix queued never computes it sooner itself, and waits.
NO_CALL_COST = replace(CHEAP_RELOAD, fixed_ms=0.0)
# A model call costs far more than a chunk's tokens: chunks that have not run yet are dearer
# than one call computing the prefix.
DEAR_CALL = replace(CHEAP_RELOAD, fixed_ms=5.0)
MODEL = RankingModel(tiny_config(), seed=7)
TOKENS = 100  # long-term behaviours per prefix
USER_FEATURES = 4
SHORT, CANDIDATES = 16, 32  # the factories' rank input
KV_BYTES = (TOKENS + USER_FEATURES) * MODEL.cfg.cache_bytes_per_token  # one prefix in a tier


class Clock:
    """The store's and scheduler's time: it stands still unless a test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Counting(NoopObserver):
    """Records every job the engine reports: one entry per computation, not per request."""

    landed: list[tuple[Work, int]] = field(default_factory=list)  # (work, tokens computed)
    scored: list[Work] = field(default_factory=list)

    def prefix_landed(self, job: Job, work: Work, computed_tokens: int, kv: PrefixKV) -> None:
        self.landed.append((work, computed_tokens))

    def ranked(self, job: Job, work: Work, call: ScoringCall | None) -> None:
        self.scored.append(work)


def virtual_time(clock: Clock) -> Executor:
    """An executor on which each step takes exactly its predicted time on `clock` (and
    unpredicted work none): what the cost model foresees is what happens."""

    def run(job: Job, step: Callable[[], Any]) -> Any:
        clock.now += job.next_step_ms / 1e3
        return step()

    return run


@contextmanager
def running_engine(
    hbm_prefixes: float = 4.0,
    relay_enabled: bool = True,
    cost: CostModel = CHEAP_RELOAD,
    executor: Callable[[Clock], Executor] | None = None,
) -> Iterator[tuple[RankerEngine, Counting]]:
    """An engine whose device tier holds `hbm_prefixes` prefixes of TOKENS behaviours;
    `executor` (of the clock): how the compute worker runs a step."""
    clock = Clock()
    store = KVStore(
        int(hbm_prefixes * KV_BYTES), 8 * KV_BYTES, dram_ttl=600.0, clock=clock,
        to_host=lambda kv: kv.to("cpu"),
    )  # fmt: skip
    run = {} if executor is None else {"executor": executor(clock)}
    settings = EngineSettings(relay_enabled, relay_window_s=30.0, prefill_chunk_tokens=64)
    observer = Counting()
    engine = RankerEngine(MODEL, store, cost, settings, observer, clock=clock, **run)
    try:
        yield engine, observer
    finally:
        engine.stop()


class Gate:
    """Holds the compute worker on a job until opened: what is submitted meanwhile stays queued."""

    def __init__(self, engine: RankerEngine) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

        def hold() -> None:
            self.entered.set()
            self.release.wait(30)

        engine.worker.run(hold)

    async def wait_entered(self) -> None:
        await eventually(self.entered.is_set, "the gate holds the worker")

    def open(self) -> None:
        self.release.set()


def assert_full_inference(result: RankResult, request: RankInput) -> None:
    expected = MODEL.full_forward(request)
    assert result.scores.dtype == expected.dtype == torch.float32
    assert result.scores.shape == expected.shape
    assert torch.allclose(result.scores, expected, rtol=1e-5, atol=0.0), (
        (result.scores - expected).abs().max()
    )


def test_hbm_hit_serves_the_pre_inferred_prefix(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="a"))
    with running_engine() as (engine, observer):

        async def scenario() -> tuple[PreInferResult, RankResult]:
            return await engine.pre_infer(request.prefix, None, None), await engine.rank(
                request, None
            )

        pre, ranked = asyncio.run(scenario())
        assert (pre.outcome, pre.tokens, pre.nbytes) == (
            PreInferOutcome.COMPUTED,
            TOKENS + USER_FEATURES,
            KV_BYTES,
        )
        assert (ranked.outcome, ranked.computed_tokens, ranked.relayed) == (
            CacheOutcome.HBM_HIT,
            SHORT + CANDIDATES,
            True,
        )
        assert observer.landed == [(Work.PREFILL, TOKENS + USER_FEATURES)]
        assert observer.scored == [Work.RANK]
        held = engine.store.peek(pre.key, Tier.HBM)
        assert held is not None and not held.pinned  # consumed: the relay is done
    assert_full_inference(ranked, request)


def test_dram_hit_reloads_the_host_copy(rng: np.random.Generator) -> None:
    a = prefix(rng, TOKENS, user_id="a")
    request = rank_input(rng, a)
    with running_engine(hbm_prefixes=1.5) as (engine, observer):  # room for one prefix

        async def scenario() -> RankResult:
            pre = await engine.pre_infer(a, None, None)
            await engine.rank(rank_input(rng, a), None)  # consumed: a may now leave the device
            await engine.pre_infer(prefix(rng, TOKENS, user_id="b"), None, None)  # pushes a out
            assert engine.store.tier_of(pre.key) is Tier.DRAM
            return await engine.rank(request, None)

        ranked = asyncio.run(scenario())
        assert (ranked.outcome, ranked.computed_tokens, ranked.relayed) == (
            CacheOutcome.DRAM_HIT,
            SHORT + CANDIDATES,
            False,
        )
        assert observer.landed[-1] == (Work.RELOAD, 0)
    assert_full_inference(ranked, request)


def test_a_rank_behind_its_queued_pre_infer_waits_for_it(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="a"))
    with running_engine(cost=NO_CALL_COST) as (engine, observer):

        async def scenario() -> tuple[PreInferResult, RankResult]:
            gate = Gate(engine)
            await gate.wait_entered()
            pre = asyncio.create_task(engine.pre_infer(request.prefix, None, None))
            await eventually(lambda: engine.inflight() == 1, "the PreInfer is in flight")
            ranked = asyncio.create_task(engine.rank(request, None))
            await eventually(
                lambda: any(e.kind == "promoted" for e in engine.queues.events),
                "the Rank joined the PreInfer's job, lifting it to rank priority",
            )
            gate.open()
            return await pre, await ranked

        pre, ranked = asyncio.run(scenario())
        assert pre.outcome is PreInferOutcome.COMPUTED
        assert (ranked.outcome, ranked.computed_tokens, ranked.relayed) == (
            CacheOutcome.WAITED_INFLIGHT,
            SHORT + CANDIDATES,
            True,
        )
        assert observer.landed == [(Work.PREFILL, TOKENS + USER_FEATURES)]
    assert_full_inference(ranked, request)


def test_a_longer_prefix_extends_the_cached_one(rng: np.random.Generator) -> None:
    short = prefix(rng, TOKENS, user_id="e")
    request = rank_input(rng, longer(rng, short, 40))
    with running_engine() as (engine, observer):

        async def scenario() -> RankResult:
            await engine.pre_infer(short, None, None)
            return await engine.rank(request, None)

        ranked = asyncio.run(scenario())
        assert (ranked.outcome, ranked.computed_tokens, ranked.relayed) == (
            CacheOutcome.EXTENDED,
            40 + SHORT + CANDIDATES,
            False,
        )
        assert observer.landed == [
            (Work.PREFILL, TOKENS + USER_FEATURES),
            (Work.EXTEND, 40),
        ]
    assert_full_inference(ranked, request)


def test_a_miss_computes_the_prefix_and_keeps_it(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="m"))
    with running_engine() as (engine, observer):

        async def scenario() -> tuple[RankResult, RankResult]:
            first = await engine.rank(request, None)
            return first, await engine.rank(rank_input(rng, request.prefix), None)

        ranked, again = asyncio.run(scenario())
        assert (ranked.outcome, ranked.computed_tokens, ranked.relayed) == (
            CacheOutcome.MISS,
            TOKENS + USER_FEATURES + SHORT + CANDIDATES,
            False,
        )
        # The return visit finds it: a cross-visit hit, not a relay.
        assert (again.outcome, again.relayed) == (CacheOutcome.HBM_HIT, False)
        # One call computed the miss: its full inference, which kept the prefix.
        assert (observer.landed, observer.scored) == ([], [Work.FULL_FORWARD, Work.RANK])
    assert_full_inference(ranked, request)


def test_bypass_serves_full_inference_and_caches_nothing(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="x"))
    with running_engine(relay_enabled=False) as (engine, observer):

        async def scenario() -> RankResult:
            with pytest.raises(Unavailable, match="relay is disabled"):
                await engine.pre_infer(request.prefix, None, None)
            return await engine.rank(request, None)

        ranked = asyncio.run(scenario())
        assert (ranked.outcome, ranked.computed_tokens, ranked.relayed) == (
            CacheOutcome.BYPASS,
            TOKENS + USER_FEATURES + SHORT + CANDIDATES,
            False,
        )
        assert (observer.landed, observer.scored) == ([], [Work.FULL_FORWARD])
        assert engine.store.usage(Tier.HBM).entries == 0
    assert torch.equal(ranked.scores, MODEL.full_forward(request))  # the very same computation


@pytest.mark.parametrize(
    ("cost", "outcome", "work", "computed"),
    [
        (CHEAP_RELOAD, CacheOutcome.DRAM_HIT, Work.RELOAD, 0),
        (DEAR_RELOAD, CacheOutcome.MISS, Work.PREFILL, TOKENS + USER_FEATURES),
    ],
    ids=["reload-when-cheaper", "recompute-when-cheaper"],
)
def test_a_host_copy_is_reloaded_only_when_cheaper_than_recomputing(
    rng: np.random.Generator, cost: CostModel, outcome: CacheOutcome, work: Work, computed: int
) -> None:
    a = rank_input(rng, prefix(rng, TOKENS, user_id="a"))
    with running_engine(hbm_prefixes=1.5, cost=cost) as (engine, observer):

        async def scenario() -> RankResult:
            await engine.rank(a, None)
            await engine.pre_infer(prefix(rng, TOKENS, user_id="b"), None, None)
            return await engine.rank(a, None)

        ranked = asyncio.run(scenario())
        assert ranked.outcome is outcome
        assert ranked.computed_tokens == computed + SHORT + CANDIDATES
        assert observer.landed[-1] == (work, computed)
    assert_full_inference(ranked, a)


def test_a_host_copy_of_a_shorter_prefix_is_extended(rng: np.random.Generator) -> None:
    """Extension starts from the user's cached prefix in either tier (a host one moves first)."""
    short = prefix(rng, TOKENS, user_id="e")
    request = rank_input(rng, longer(rng, short, 40))
    with running_engine(hbm_prefixes=1.5) as (engine, observer):

        async def scenario() -> RankResult:
            pre = await engine.pre_infer(short, None, None)
            await engine.rank(rank_input(rng, short), None)
            await engine.pre_infer(prefix(rng, TOKENS, user_id="b"), None, None)
            assert engine.store.tier_of(pre.key) is Tier.DRAM
            return await engine.rank(request, None)

        ranked = asyncio.run(scenario())
        assert ranked.outcome is CacheOutcome.EXTENDED
        assert observer.landed[-1] == (Work.EXTEND, 40)
    assert_full_inference(ranked, request)


def test_concurrent_requests_for_one_prefix_compute_it_once(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="a"))
    with running_engine() as (engine, observer):

        async def scenario() -> list[PreInferResult | RankResult]:
            gate = Gate(engine)  # everyone arrives while the computation is queued
            await gate.wait_entered()
            calls: list[Coroutine[Any, Any, PreInferResult | RankResult]] = [
                engine.pre_infer(request.prefix, None, None) for _ in range(8)
            ]
            calls += [engine.rank(request, None) for _ in range(8)]
            tasks = [asyncio.create_task(calls[i]) for i in rng.permutation(len(calls))]
            await eventually(lambda: engine.inflight() == 1, "the prefix is in flight")
            gate.open()
            return list(await asyncio.gather(*tasks))

        results = asyncio.run(scenario())
        # Computed once: a PreInfer's prefill, or a Rank's full inference keeping the prefix
        # (the first to arrive, or one restarting the queued prefill as its own call).
        full = observer.scored.count(Work.FULL_FORWARD)
        assert observer.landed == [(Work.PREFILL, TOKENS + USER_FEATURES)] * (1 - full)
        assert sorted(observer.scored) == sorted(
            [Work.FULL_FORWARD] * full + [Work.RANK] * (8 - full)
        )
        outcomes = [r.outcome for r in results]
        computing = {PreInferOutcome.COMPUTED, CacheOutcome.MISS}
        assert sum(o in computing for o in outcomes) == 1, outcomes
        assert set(outcomes) - computing <= {
            PreInferOutcome.JOINED_INFLIGHT,
            CacheOutcome.WAITED_INFLIGHT,
        }
    ranks = [r for r in results if isinstance(r, RankResult)]
    assert len(ranks) == 8
    for ranked in ranks:
        assert_full_inference(ranked, request)
