"""The engine batches Ranks exactly: users with different prefix, short-term and candidate lengths,
queued together behind a held worker, are scored in one model call, and each gets its own
scores, equal to its scores alone and to the dense reference. Random inputs, seed printed."""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch

from relaygr.behaviours import RankInput
from relaygr.cost import CallShape
from services.ranker.core_types import Action, CoreStats, FullForward, RunBatch, RunStep, Score
from services.ranker.engine import EngineSettings, RankerEngine, RankResult
from services.ranker.kv_store import KVStore
from services.ranker.observer import EngineObserver, NoopObserver, Work
from services.ranker.queues import Priority
from tests.polling import eventually
from tests.unit.ranker.dense_reference import DenseReference
from tests.unit.ranker.factories import prefix, rank_input, rel_err
from tests.unit.ranker.test_engine import CHEAP_RELOAD, MODEL, Clock, Gate
from tests.unit.ranker.test_model_batch import BATCH_NOISE, FP32_TOLERANCE

USERS = 6
# batch_backlog=1: any queued Rank may join (these tests are of the calls, not of when to batch).
SETTINGS = EngineSettings(
    relay_enabled=True,
    relay_window_s=30.0,
    prefill_chunk_tokens=64,
    batch_backlog=1,
    max_chunk_batch_rows=4096,
)


def _requests(rng: np.random.Generator) -> list[RankInput]:
    """USERS users, each a different mix: empty to multi-block prefixes, 0-40 short-term
    behaviours, 1-48 candidates."""
    lengths = rng.permutation([0, 7, 63, 65, 200, 330])[:USERS]
    out = []
    for i, n_long in enumerate(lengths):
        p = prefix(rng, int(n_long), int(rng.integers(1, 9)), user_id=f"u{i}")
        out.append(rank_input(rng, p, int(rng.integers(0, 41)), int(rng.integers(1, 49))))
    print("users (prefix, short-term, candidates):", [
        (r.prefix.num_tokens, len(r.short_term), len(r.candidates)) for r in out
    ])  # fmt: skip
    return out


def _engine(
    settings: EngineSettings,
    record: Callable[[Action], None],
    observer: EngineObserver | None = None,
) -> RankerEngine:
    """An engine of `settings` whose core's every action goes to `record`."""
    clock = Clock()
    store = KVStore(1 << 30, 0, dram_ttl=600.0, clock=clock, to_host=lambda kv: kv.to("cpu"))
    return RankerEngine(MODEL, store, CHEAP_RELOAD, settings, observer, clock=clock, record=record)


async def _ranked_together(engine: RankerEngine, requests: list[RankInput]) -> list[RankResult]:
    """The Ranks of `requests`, all queued while a gate holds the worker, then let through."""
    gate = Gate(engine)
    await gate.wait_entered()
    tasks = [asyncio.create_task(engine.rank(r, None)) for r in requests]
    await eventually(
        lambda: engine.queues.depth(Priority.RANK) == len(requests), "every Rank queued"
    )
    gate.open()
    return list(await asyncio.gather(*tasks))


def _check(
    requests: list[RankInput], results: list[RankResult], alone: list[torch.Tensor] | None
) -> None:
    """Each result equals the dense reference, and (`alone` given) the request's scores alone."""
    reference = DenseReference(MODEL)
    for i, (request, result) in enumerate(zip(requests, results, strict=True)):
        expected = reference.forward(request).scores
        print(
            f"prefix={request.prefix.num_tokens} short={len(request.short_term)} "
            f"candidates={len(request.candidates)}: vs oracle "
            f"{rel_err(result.scores, expected):.1e}"
            + ("" if alone is None else f", vs alone {rel_err(result.scores, alone[i]):.1e}")
        )
        assert result.scores.shape == (2, len(request.candidates))
        assert rel_err(result.scores, expected) <= FP32_TOLERANCE
        if alone is not None:
            assert rel_err(result.scores, alone[i]) <= BATCH_NOISE


def _call_sizes(log: list[Action]) -> list[int]:
    """Ranks per scoring call, in order."""
    sizes = []
    for action in log:
        if isinstance(action, RunBatch):
            sizes.append(len(action.jobs))
        elif isinstance(action, RunStep) and isinstance(action.job.spec, Score | FullForward):
            sizes.append(1)
    return sizes


def _served(
    settings: EngineSettings,
    serve: Callable[[RankerEngine, list[RankInput]], Awaitable[list[RankResult]]],
    requests: list[RankInput],
) -> tuple[list[RankResult], list[Action], CoreStats]:
    """`serve(engine, requests)` on a fresh engine of `settings`: its results, the actions the
    engine's core took, and its stats after."""
    log: list[Action] = []
    engine = _engine(settings, log.append)
    try:
        results = asyncio.run(serve(engine, requests))
        return results, log, engine.stats()
    finally:
        engine.stop()


async def _cached_then_ranked_together(
    engine: RankerEngine, requests: list[RankInput]
) -> list[RankResult]:
    """Every request's prefix pre-inferred, then the Ranks served together."""
    for r in requests:
        await engine.pre_infer(r.prefix, None, None)
    return await _ranked_together(engine, requests)


def test_ranks_served_in_one_batch_score_as_alone_and_as_the_dense_reference(
    rng: np.random.Generator,
) -> None:
    requests = _requests(rng)
    results, log, stats = _served(SETTINGS, _cached_then_ranked_together, requests)
    [batch] = [a for a in log if isinstance(a, RunBatch)]
    assert [job.spec.request.request for job in batch.jobs] == requests  # one call, in order
    assert all(isinstance(job.spec, Score) for job in batch.jobs)
    assert not any(isinstance(a, RunStep) and isinstance(a.job.spec, Score) for a in log)
    kvs = [job.spec.kv for job in batch.jobs]
    alone = [
        MODEL.rank(kv, r.short_term, r.candidates, r.request_ts)
        for kv, r in zip(kvs, requests, strict=True)
    ]
    _check(requests, results, alone)
    assert stats.batch_requests.count == 1 and stats.batch_requests.total == USERS


def test_full_inferences_served_in_one_batch_score_as_alone(rng: np.random.Generator) -> None:
    requests = _requests(rng)
    results, log, _stats = _served(
        replace(SETTINGS, relay_enabled=False), _ranked_together, requests
    )
    [batch] = [a for a in log if isinstance(a, RunBatch)]
    assert all(isinstance(job.spec, FullForward) for job in batch.jobs)
    assert len(batch.jobs) == USERS
    _check(requests, results, [MODEL.full_forward(r) for r in requests])


@pytest.mark.parametrize("max_batch_requests", [1, 4])
def test_max_batch_bounds_the_calls(rng: np.random.Generator, max_batch_requests: int) -> None:
    requests = _requests(rng)
    results, log, _stats = _served(
        replace(SETTINGS, max_batch_requests=max_batch_requests),
        _cached_then_ranked_together,
        requests,
    )
    sizes = _call_sizes(log)
    assert sizes == ([1] * USERS if max_batch_requests == 1 else [4, 2])
    _check(requests, results, None)


@dataclass
class Timings(NoopObserver):
    """The compute timings the engine reports: single calls and batched calls."""

    single: list[Work] = field(default_factory=list)
    batches: list[tuple[Work, tuple[CallShape, ...], float]] = field(default_factory=list)

    def computed(
        self, work: Work, tokens: int, cached_tokens: int | None, candidates: int, seconds: float
    ) -> None:
        self.single.append(work)

    def batch_computed(self, work: Work, shapes: tuple[CallShape, ...], seconds: float) -> None:
        self.batches.append((work, shapes, seconds))


def test_a_batched_call_reports_its_time_once_with_its_shapes(rng: np.random.Generator) -> None:
    """What the ranker's cost learner is fed (`server.LearnerSink`): the call's time, once, with
    every Rank's shape in call order; no Rank of it reported as a single call."""
    requests = _requests(rng)
    timings = Timings()
    log: list[Action] = []
    engine = _engine(SETTINGS, log.append, timings)
    try:
        asyncio.run(_cached_then_ranked_together(engine, requests))
    finally:
        engine.stop()
    [(work, shapes, seconds)] = timings.batches
    assert work is Work.RANK and seconds > 0
    assert shapes == tuple(
        CallShape(r.prefix.num_tokens, len(r.short_term), len(r.candidates)) for r in requests
    )
    assert Work.RANK not in timings.single
    assert timings.single.count(Work.PREFILL) == USERS  # the PreInfers, each its own call
