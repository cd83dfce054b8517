"""RankerEngine's background prefill: run in the order its Ranks are expected, reported as queued
compute time, and waited for by a Rank only when that is predicted sooner than computing it."""

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from relaygr.cost import CallShape
from services.ranker.engine import (
    CacheOutcome,
    Executor,
    PreInferOutcome,
    RankerEngine,
    RankResult,
)
from services.ranker.observer import Work
from services.ranker.queues import Job, Priority
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input
from tests.unit.ranker.test_engine import (
    CANDIDATES,
    CHEAP_RELOAD,
    SHORT,
    TOKENS,
    USER_FEATURES,
    Clock,
    Gate,
    assert_full_inference,
    running_engine,
    virtual_time,
)

LONG = 300  # behaviours: with 4 user features, 5 chunks of at most 64 tokens
LONG_TOKENS = LONG + USER_FEATURES
COST = CHEAP_RELOAD  # 1 ms per model call, 0.01 ms per token


def first_steps(engine: RankerEngine) -> list[str]:
    """The prefill jobs in the order the worker first took them."""
    taken = [e.job for e in engine.queues.events if e.kind == "step"]
    return [
        job for i, job in enumerate(taken) if job.startswith("prefill:") and job not in taken[:i]
    ]


def finished_at(engine: RankerEngine, job: str) -> float:
    """When (the injected clock) the last job named `job` finished."""
    return [e.at for e in engine.queues.events if e.kind == "done" and e.job == job][-1]


def test_background_prefill_runs_in_the_order_its_ranks_are_expected(
    rng: np.random.Generator,
) -> None:
    expected_in = {"late": 3.0, "soon": 1.0, "unknown": None, "middle": 2.0}
    with running_engine() as (engine, _):

        async def scenario() -> dict[str, float | None]:
            gate = Gate(engine)
            await gate.wait_entered()
            calls = [
                asyncio.create_task(
                    engine.pre_infer(prefix(rng, TOKENS, user_id=user), None, None, wait)
                )
                for user, wait in expected_in.items()
            ]
            await eventually(lambda: engine.inflight() == 4, "every PreInfer is queued")
            dues = {i.job.name: i.job.due for i in engine.core.flights.values()}
            gate.open()
            await asyncio.gather(*calls)
            return dues

        dues = asyncio.run(scenario())
    now = Clock().now  # the clock stands still: every PreInfer arrived at its start
    assert dues == {
        "prefill:late": now + 3.0,
        "prefill:soon": now + 1.0,
        "prefill:unknown": now + 30.0,  # no expectation: the end of the relay window
        "prefill:middle": now + 2.0,
    }
    assert first_steps(engine) == [
        "prefill:soon",
        "prefill:middle",
        "prefill:late",
        "prefill:unknown",
    ]


def test_queued_prefill_time_rises_with_pre_infers_and_returns_to_zero(
    rng: np.random.Generator,
) -> None:
    # Two calls (64 + 40 tokens): the one-call prefill time and one more call's fixed cost.
    per_prefix = COST.prefill_ms(TOKENS + USER_FEATURES) + COST.fixed_ms
    with running_engine(cost=COST) as (engine, _):

        async def scenario() -> list[float]:
            gate = Gate(engine)
            await gate.wait_entered()
            seen = [engine.queues.queued_background_ms()]
            calls = []
            for n, user in enumerate(("a", "b"), start=1):
                p = prefix(rng, TOKENS, user_id=user)
                calls.append(asyncio.create_task(engine.pre_infer(p, None, None)))
                await eventually(lambda n=n: engine.inflight() == n, "queued")  # type: ignore[misc]
                seen.append(engine.queues.queued_background_ms())
            gate.open()
            await asyncio.gather(*calls)
            seen.append(engine.queues.queued_background_ms())
            return seen

        seen = asyncio.run(scenario())
    assert seen[0] == 0.0
    assert seen[1:3] == [pytest.approx(per_prefix), pytest.approx(2 * per_prefix)]
    assert seen[3] == 0.0  # drained: exactly


def pausing(holder: dict[str, Gate], engine: Callable[[], RankerEngine], job: str, after: int):
    """A virtual-time executor that holds the worker (a Gate) once `job` has run `after` steps:
    the job is then queued, part computed."""

    def make(clock: Clock) -> Executor:
        run = virtual_time(clock)

        def step(j: Job, compute: Callable[[], Any]) -> Any:
            result = run(j, compute)
            if j.name == job and j.steps_run + 1 == after and "gate" not in holder:
                holder["gate"] = Gate(engine())
            return result

        return step

    return make


def test_a_rank_waits_for_a_half_computed_prefix_when_that_is_sooner(
    rng: np.random.Generator,
) -> None:
    request = rank_input(rng, prefix(rng, LONG, user_id="a"))
    holder: dict[str, Gate] = {}
    engines: list[RankerEngine] = []
    executor = pausing(holder, lambda: engines[0], "prefill:a", after=3)
    with running_engine(hbm_prefixes=12, cost=COST, executor=executor) as (engine, observer):
        engines.append(engine)

        async def scenario() -> tuple[float, float, RankResult, PreInferOutcome]:
            pre = asyncio.create_task(engine.pre_infer(request.prefix, None, None))
            await eventually(lambda: "gate" in holder, "three of five chunks ran")
            await holder["gate"].wait_entered()
            [inflight] = engine.core.flights.values()
            arrived, remaining = engine.core.clock(), inflight.job.remaining_ms
            ranked = asyncio.create_task(engine.rank(request, None))
            await eventually(
                lambda: inflight.job.priority is Priority.RANK, "the Rank promoted the job"
            )
            holder["gate"].open()
            return arrived, remaining, await ranked, (await pre).outcome

        arrived, remaining, ranked, pre = asyncio.run(scenario())
        done = finished_at(engine, "rank")
        assert (ranked.outcome, ranked.computed_tokens, ranked.relayed) == (
            CacheOutcome.WAITED_INFLIGHT,
            SHORT + CANDIDATES,
            True,
        )
        assert pre is PreInferOutcome.COMPUTED
        assert observer.landed == [(Work.PREFILL, LONG_TOKENS)]  # computed once
        assert [e.kind for e in engine.queues.events].count("restarted") == 0
    in_full = COST.prefill_ms(LONG_TOKENS) / 1e3  # one call, from the Rank's arrival
    scoring = COST.shape_ms(CallShape(LONG_TOKENS, SHORT, CANDIDATES)) / 1e3
    # The last two chunks, then the Rank's own scoring.
    assert done - arrived == pytest.approx(remaining / 1e3 + scoring)
    assert done - arrived < in_full + scoring
    assert_full_inference(ranked, request)


def test_a_rank_computes_a_far_behind_queued_prefix_itself_when_that_is_sooner(
    rng: np.random.Generator,
) -> None:
    request = rank_input(rng, prefix(rng, LONG, user_id="a"))
    others = [rank_input(rng, prefix(rng, TOKENS, user_id=u)) for u in ("b", "c")]
    with running_engine(hbm_prefixes=12, cost=COST, executor=virtual_time) as (engine, observer):

        async def scenario() -> tuple[float, float, RankResult, list[PreInferOutcome]]:
            gate = Gate(engine)
            await gate.wait_entered()
            pres = [  # other users' Ranks are due sooner: a's prefill is queued behind theirs
                asyncio.create_task(engine.pre_infer(o.prefix, None, None, 0.001)) for o in others
            ]
            pres.append(asyncio.create_task(engine.pre_infer(request.prefix, None, None, 5.0)))
            await eventually(lambda: engine.inflight() == 3, "every PreInfer is queued")
            arrived = engine.core.clock()
            chunked = engine.core.flights[engine.key(request.prefix)].job.remaining_ms
            ranked = asyncio.create_task(engine.rank(request, None))
            await eventually(
                lambda: any(e.kind == "restarted" for e in engine.queues.events),
                "the Rank took a's prefill over",
            )
            gate.open()
            outcomes = [r.outcome for r in await asyncio.gather(*pres)]
            return arrived, chunked, await ranked, outcomes

        arrived, chunked, ranked, pres = asyncio.run(scenario())
        # The prefix the Rank took over, computed in one call: the Rank's full inference, which
        # keeps the prefix and answers the Rank.
        done = finished_at(engine, "prefill:a")
        assert (ranked.outcome, ranked.computed_tokens, ranked.relayed) == (
            CacheOutcome.MISS,
            LONG_TOKENS + SHORT + CANDIDATES,
            False,
        )
        # b and c computed theirs; a's PreInfer shared the Rank's computation.
        assert pres == [PreInferOutcome.COMPUTED] * 2 + [PreInferOutcome.JOINED_INFLIGHT]
        assert observer.landed == [(Work.PREFILL, TOKENS + USER_FEATURES)] * 2
        assert observer.scored == [Work.FULL_FORWARD]
        assert first_steps(engine) == ["prefill:a", "prefill:b", "prefill:c"]  # ranking first
    in_full = COST.full_ms(request.history_tokens, CANDIDATES) / 1e3
    assert chunked == pytest.approx(COST.prefill_ms(LONG_TOKENS) + 4 * COST.fixed_ms)
    assert done - arrived == pytest.approx(in_full)  # no later than computing in full
    assert_full_inference(ranked, request)


def test_every_request_for_a_queued_prefix_gets_exact_scores(rng: np.random.Generator) -> None:
    """Take-over and waiting together: one computation, every Rank exact."""
    request = rank_input(rng, prefix(rng, LONG, user_id="a"))
    with running_engine(hbm_prefixes=12, cost=COST) as (engine, observer):

        async def scenario() -> list[RankResult]:
            gate = Gate(engine)
            await gate.wait_entered()
            pre = asyncio.create_task(engine.pre_infer(request.prefix, None, None))
            await eventually(lambda: engine.inflight() == 1, "the PreInfer is queued")
            # All four reach the in-flight job in one turn of the loop: the first takes it
            # over (not started: five calls are dearer than one), the others wait for it.
            ranks = [asyncio.create_task(engine.rank(request, None)) for _ in range(4)]
            await eventually(
                lambda: any(e.kind == "restarted" for e in engine.queues.events),
                "a Rank took it over",
            )
            gate.open()
            await pre
            return list(await asyncio.gather(*ranks))

        ranks = asyncio.run(scenario())
        # Computed once, as the first Rank's full inference, keeping the prefix.
        assert observer.landed == []
        assert sorted(observer.scored) == [Work.FULL_FORWARD] + [Work.RANK] * 3
    outcomes = sorted(r.outcome for r in ranks)
    assert outcomes == [CacheOutcome.MISS] + [CacheOutcome.WAITED_INFLIGHT] * 3
    for ranked in ranks:
        assert_full_inference(ranked, request)


def test_a_hit_is_scored_before_the_remaining_chunks_of_a_background_prefill(
    rng: np.random.Generator,
) -> None:
    """A Rank's scoring step runs at rank priority: a hit that arrives while another user's
    prefill is part computed is scored before that prefill's remaining chunks run."""
    hit = rank_input(rng, prefix(rng, TOKENS, user_id="a"))
    background = prefix(rng, LONG, user_id="b")
    holder: dict[str, Gate] = {}
    engines: list[RankerEngine] = []
    executor = pausing(holder, lambda: engines[0], "prefill:b", after=2)
    with running_engine(hbm_prefixes=12, cost=COST, executor=executor) as (engine, _):
        engines.append(engine)

        async def scenario() -> tuple[RankResult, PreInferOutcome]:
            await engine.pre_infer(hit.prefix, None, None)  # a's prefix is resident
            pre = asyncio.create_task(engine.pre_infer(background, None, None))
            await eventually(lambda: "gate" in holder, "two of b's five chunks ran")
            await holder["gate"].wait_entered()
            ranked = asyncio.create_task(engine.rank(hit, None))
            await eventually(
                lambda: any(e.job == "rank" for e in engine.queues.events),
                "the hit's scoring step is queued",
            )
            holder["gate"].open()
            return await ranked, (await pre).outcome

        ranked, pre = asyncio.run(scenario())
        events = engine.queues.events
    assert (ranked.outcome, pre) == (CacheOutcome.HBM_HIT, PreInferOutcome.COMPUTED)
    scored = next(e.seq for e in events if e.job == "rank" and e.kind == "done")
    chunks = [e.seq for e in events if e.job == "prefill:b" and e.kind == "step"]
    # Two steps ran before the hit arrived; every remaining one (the last ends the job) after.
    assert [seq < scored for seq in chunks] == [True] * 2 + [False] * (len(chunks) - 2)
    assert len(chunks) > 2
    assert {e.priority for e in events if e.job == "rank"} == {Priority.RANK}
    assert_full_inference(ranked, hit)
