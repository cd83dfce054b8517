"""The engine batches background prefill chunks exactly: several users' PreInfers, queued together
behind a held worker, have their chunks computed in shared model calls (`chunk_batch`), from
nothing or on a cached prefix, and each user's cached prefix equals its one-by-one prefill; Ranks
on them score as the dense reference. Random inputs, seed printed."""

import asyncio
from dataclasses import dataclass

import numpy as np
import torch

from relaygr.behaviours import Prefix, RankInput
from services.ranker.core_types import (
    Action,
    Extend,
    FullForward,
    Prefill,
    Reload,
    RunBatch,
    RunStep,
    Score,
)
from services.ranker.engine import RankerEngine, RankResult
from services.ranker.outcomes import CacheOutcome
from services.ranker.queues import Job, Priority
from tests.polling import eventually
from tests.unit.ranker.dense_reference import DenseReference
from tests.unit.ranker.factories import longer, prefix, rank_input, rel_err
from tests.unit.ranker.test_engine import MODEL, Gate
from tests.unit.ranker.test_engine_batch import SETTINGS, _engine
from tests.unit.ranker.test_model_batch import BATCH_NOISE, FP32_TOLERANCE


@dataclass(frozen=True, slots=True)
class Step:
    """A job's step in a call, as the call started: its user, spec type, step index, priority."""

    user: str
    kind: type
    index: int
    priority: Priority


def _started(action: Action, calls: list[list[Step]]) -> None:
    """`action`'s call, if it starts one, appended to `calls` (the jobs change as they run)."""
    if isinstance(action, RunStep):
        jobs: tuple[Job, ...] = (action.job,)
    elif isinstance(action, RunBatch):
        jobs = action.jobs
    else:
        return
    calls.append([Step(_user(j.spec), type(j.spec), j.steps_run, j.priority) for j in jobs])


def _user(spec: object) -> str:
    if isinstance(spec, Prefill | Extend):
        return str(spec.prefix.user_id)
    assert isinstance(spec, Score | FullForward | Reload)
    return "" if isinstance(spec, Reload) else str(spec.request.prefix.user_id)


def _prefixes(rng: np.random.Generator) -> list[Prefix]:
    """Users with empty to multi-chunk prefixes (64-token chunks), 1-8 user features each."""
    lengths = rng.permutation([0, 7, 63, 65, 200, 330])
    out = [
        prefix(rng, int(n), int(rng.integers(1, 9)), user_id=f"u{i}") for i, n in enumerate(lengths)
    ]
    print("prefix tokens:", [p.num_tokens for p in out])
    return out


async def _pre_inferred_together_then_ranked(
    engine: RankerEngine, base: Prefix, prefixes: list[Prefix], requests: list[RankInput]
) -> list[RankResult]:
    """`base` pre-inferred alone; then, while a gate holds the worker, a PreInfer of each of
    `prefixes` (the first extends `base`), queued together and let through; then `requests`
    ranked one by one."""
    await engine.pre_infer(base, None, None)
    gate = Gate(engine)
    await gate.wait_entered()
    tasks = [asyncio.create_task(engine.pre_infer(p, None, None)) for p in prefixes]
    await eventually(
        lambda: engine.queues.depth(Priority.BACKGROUND) == len(prefixes), "every PreInfer queued"
    )
    gate.open()
    await asyncio.gather(*tasks)
    return [await engine.rank(r, None) for r in requests]


def test_batched_chunks_cache_each_prefix_as_its_own_prefill(rng: np.random.Generator) -> None:
    base = prefix(rng, 90, 4, user_id="e")
    extended = longer(rng, base, 150)  # an Extend: its chunks run on the cached 90
    prefixes = [extended, *_prefixes(rng)]
    requests = [rank_input(rng, p, int(rng.integers(0, 41)), 24) for p in prefixes]
    calls: list[list[Step]] = []  # each call's steps, as it started
    engine = _engine(SETTINGS, lambda action: _started(action, calls))
    try:
        results = asyncio.run(_pre_inferred_together_then_ranked(engine, base, prefixes, requests))
        cached = [engine.held_for_peer(engine.key(p)) for p in prefixes]
    finally:
        engine.stop()
    print("calls:", [len(call) for call in calls])
    # The extension brings its base over alone; then its first chunk leads every other user's
    # first chunk in one call (chunk_batch: Extension and Prefix items together).
    chunk_calls = [call for call in calls if len(call) > 1]
    assert chunk_calls, "no chunk was batched"
    users = [p.user_id for p in prefixes]
    assert chunk_calls[0] == [
        Step(users[0], Extend, 1, Priority.BACKGROUND),
        *(Step(user, Prefill, 0, Priority.BACKGROUND) for user in users[1:]),
    ]
    assert all(
        step.kind in (Prefill, Extend) and step.priority is Priority.BACKGROUND
        for call in chunk_calls
        for step in call
    )
    for p, held in zip(prefixes, cached, strict=True):
        assert held is not None
        kv, whole = held[0], MODEL.prefill(p)
        err = max(rel_err(kv.keys, whole.keys), rel_err(kv.values, whole.values))
        print(f"prefix={p.num_tokens}: cached K/V vs one prefill {err:.1e}")
        assert (kv.num_tokens, kv.digest) == (whole.num_tokens, whole.digest)
        assert err <= BATCH_NOISE
        assert torch.equal(kv.timestamps, whole.timestamps)
    reference = DenseReference(MODEL)
    for request, result in zip(requests, results, strict=True):
        assert result.outcome is CacheOutcome.HBM_HIT
        assert rel_err(result.scores, reference.forward(request).scores) <= FP32_TOLERANCE
