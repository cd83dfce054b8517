"""The simulator's rankers batch as the service does (the one core decides), and a batched call
takes the cost model's batch time (`relaygr.cost.batch_ms`), not the sum of its singles."""

import random

import pytest

from relaygr.cost import CallShape, CostModel, batch_ms
from services.ranker.core_types import Action, CoreSettings, RunBatch, RunStep, Score
from tooling.sim.events import EventLoop
from tooling.sim.profile import DeviceProfile
from tooling.sim.ranker import PreInferReply, RankReply, SimRanker, Status
from tooling.sim.workload import Visit

COST = CostModel(
    fixed_ms=2.0, per_token_ms=0.01, per_pair_ms=1e-6, per_candidate_key_ms=1e-5,
    reload_ms_per_mb=0.01, batch_saving_ms=1.5, batch_samples=10,
)  # fmt: skip
PROFILE = DeviceProfile("batch", COST, 1 << 30, 1 << 30, kv_bytes_per_token=100)


def visit(user: str, behaviours: int, short_term: int, candidates: int) -> Visit:
    return Visit(0.0, user, 4, behaviours, short_term, candidates)


@pytest.mark.parametrize("max_batch_requests", [1, 8])
def test_ranks_queued_together_run_as_one_call_timed_by_the_batch_term(
    max_batch_requests: int,
) -> None:
    loop = EventLoop()
    log: list[Action] = []
    settings = CoreSettings(
        relay_enabled=True, relay_window_s=30.0, prefill_chunk_tokens=4096,
        max_batch_requests=max_batch_requests,
    )  # fmt: skip
    ranker = SimRanker("r0", loop, PROFILE, settings, 300.0, random.Random(0), record=log.append)
    visits = [visit("a", 100, 8, 16), visit("b", 300, 4, 32), visit("c", 50, 16, 8)]
    pre: list[PreInferReply] = []
    for v in visits:
        ranker.pre_infer(v, 30.0, None, None, pre.append)
    loop.run()
    assert [r.status for r in pre] == [Status.OK] * 3
    ranked: dict[str, float] = {}
    busy_before, start = ranker.busy_s, loop.now
    # A background prefill holds the worker (one chunk) while the Ranks queue behind it.
    ranker.pre_infer(
        visit("g", 200, 0, 0), 30.0, None, None, lambda _: ranked.setdefault("g", loop.now)
    )
    for v in visits:

        def done(reply: RankReply, user: str = v.user) -> None:
            assert reply.status is Status.OK
            ranked[user] = loop.now

        ranker.rank(v, None, done)
    loop.run()
    shapes = [CallShape(4 + v.behaviours, v.short_term, v.candidates) for v in visits]
    singles_s = sum(batch_ms(COST, [s]) for s in shapes) / 1e3
    batch_s = batch_ms(COST, shapes) / 1e3
    assert batch_s < singles_s
    held_s = ranked["g"] - start
    assert held_s == pytest.approx(COST.prefill_ms(4 + 200) / 1e3)
    # The scoring calls (the PreInfers' chunks before may batch too: test_chunks_... below).
    batches = [a for a in log if isinstance(a, RunBatch) and isinstance(a.jobs[0].spec, Score)]
    if max_batch_requests == 1:
        assert batches == []
        assert ranked["c"] - start == pytest.approx(held_s + singles_s)
        assert ranker.busy_s - busy_before == pytest.approx(held_s + singles_s)
        assert ranker.core.stats().batch_requests.count == 3
        return
    [batch] = batches
    assert [job.spec.request.prefix.user_id for job in batch.jobs] == ["a", "b", "c"]
    assert not any(isinstance(a, RunStep) and isinstance(a.job.spec, Score) and
                   a.job.spec.request.prefix.user_id in "abc" for a in log)  # fmt: skip
    assert [ranked[v.user] - start for v in visits] == [pytest.approx(held_s + batch_s)] * 3
    assert ranker.busy_s - busy_before == pytest.approx(held_s + batch_s)
    stats = ranker.core.stats().batch_requests
    assert (stats.count, stats.total) == (1, 3)


@pytest.mark.parametrize("max_batch_requests", [1, 8])
def test_prefill_chunks_of_users_queued_together_run_as_one_call_timed_by_the_batch_term(
    max_batch_requests: int,
) -> None:
    """Three PreInfers arrive at once: a's first chunk starts at once, alone; b's and c's
    (one chunk each) queue behind it and then share one call with a's second chunk, timed by
    the batch term over the chunks' shapes."""
    loop = EventLoop()
    log: list[Action] = []
    settings = CoreSettings(
        relay_enabled=True, relay_window_s=30.0, prefill_chunk_tokens=64,
        max_batch_requests=max_batch_requests, batch_backlog=1, max_chunk_batch_rows=4096,
    )  # fmt: skip
    ranker = SimRanker("r0", loop, PROFILE, settings, 300.0, random.Random(0), record=log.append)
    landed: dict[str, float] = {}
    for v in (visit("a", 100, 0, 0), visit("b", 60, 0, 0), visit("c", 30, 0, 0)):

        def done(reply: PreInferReply, user: str = v.user) -> None:
            assert reply.status is Status.OK
            landed[user] = loop.now

        ranker.pre_infer(v, 30.0, None, None, done)
    loop.run()
    first = batch_ms(COST, [CallShape(0, 64, 0)]) / 1e3  # a's first chunk: 4 + 60 tokens
    shapes = [CallShape(64, 40, 0), CallShape(0, 64, 0), CallShape(0, 34, 0)]  # a, b, c
    singles = [batch_ms(COST, [s]) / 1e3 for s in shapes]
    batch = batch_ms(COST, shapes) / 1e3
    assert batch < sum(singles)
    calls = [a.jobs if isinstance(a, RunBatch) else (a.job,) for a in log
             if isinstance(a, RunStep | RunBatch)]  # fmt: skip
    steps = [[(job.spec.prefix.user_id, len(job.step_ms)) for job in call] for call in calls]
    if max_batch_requests == 1:
        assert steps == [[("a", 2)], [("a", 2)], [("b", 1)], [("c", 1)]]
        assert landed == pytest.approx({
            "a": first + singles[0], "b": first + sum(singles[:2]), "c": first + sum(singles)
        })  # fmt: skip
        assert ranker.busy_s == pytest.approx(first + sum(singles))
        return
    assert steps == [[("a", 2)], [("a", 2), ("b", 1), ("c", 1)]]
    assert landed == pytest.approx({"a": first + batch, "b": first + batch, "c": first + batch})
    assert ranker.busy_s == pytest.approx(first + batch)
    assert ranker.core.stats().batch_requests.count == 0  # the statistics are of scoring calls
