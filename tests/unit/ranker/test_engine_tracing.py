"""The engine's spans: a Rank links to the span that produced the cache it used, on every path.

Request spans stand in for the gRPC server spans; spans are collected in memory.
"""

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from relaygr.behaviours import RankInput
from relaygr.cost import CostModel
from services.ranker.config import MIB, RankerConfig
from services.ranker.engine import CacheOutcome, RankerEngine
from services.ranker.fetch import PeerFetch
from services.ranker.kv_store import Tier
from services.ranker.model import RankingModel
from services.ranker.prefix_kv import PrefixKV
from services.ranker.queues import Priority
from services.ranker.server import build_engine
from services.ranker.tracing_observer import TracingObserver
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input, tiny_config
from tests.unit.ranker.test_engine import Gate

# Reloading a host copy is far cheaper than recomputing: DRAM hits reload. No cost per model
# call: a Rank waits for its queued PreInfer (chunks cost no more than one call).
COST = CostModel(
    fixed_ms=0.0, per_token_ms=0.01, per_pair_ms=1e-6, per_candidate_key_ms=1e-5,
    reload_ms_per_mb=0.01,
)  # fmt: skip
MODEL = RankingModel(tiny_config(), seed=7)
TOKENS = 100  # long-term behaviours per prefix (+4 user features)


class Traced:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer: Tracer = provider.get_tracer("test")

    def spans(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        [span] = self.spans(name)
        return span


@pytest.fixture
def traced() -> Traced:
    return Traced()


def _engine(
    tracer: Tracer | None,
    hbm_entries: float,
    peer_fetch: PeerFetch | None = None,
    batch_backlog: int = 4,
) -> Iterator[RankerEngine]:
    """The engine as the ranker server builds it (its host copies traced as tier moves), observed
    through OpenTelemetry when there is a tracer."""
    mib = (TOKENS + 4) * MODEL.cfg.cache_bytes_per_token / MIB
    cfg = RankerConfig(
        plaintext=True, hbm_budget_mb=hbm_entries * mib, dram_budget_mb=8 * mib,
        relay_window_ms=60_000, prefill_chunk_tokens=64, batch_backlog=batch_backlog,
    )  # fmt: skip
    observer = None if tracer is None else TracingObserver(tracer)
    engine = build_engine(cfg, MODEL, COST, observer=observer, peer_fetch=peer_fetch)
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def engine(traced: Traced) -> Iterator[RankerEngine]:
    yield from _engine(traced.tracer, hbm_entries=1.5)  # room for one prefix


def _link_of(span: ReadableSpan) -> tuple[int, int] | None:
    if not span.links:
        return None
    [link] = span.links
    assert link.attributes is not None and link.attributes["relaygr.link"] == "relay"
    return link.context.trace_id, link.context.span_id


def _ids(span: ReadableSpan) -> tuple[int, int]:
    assert span.context is not None
    return span.context.trace_id, span.context.span_id


async def test_hbm_hit_links_to_the_pre_infer(
    traced: Traced, engine: RankerEngine, rng: np.random.Generator
) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="a"))

    with traced.tracer.start_as_current_span("PreInfer"):
        await engine.pre_infer(request.prefix, None, None)
    with traced.tracer.start_as_current_span("Rank"):
        outcome = (await engine.rank(request, None)).outcome
    assert outcome is CacheOutcome.HBM_HIT
    pre_infer, rank = traced.one("PreInfer"), traced.one("Rank")
    assert _link_of(rank) == _ids(pre_infer)
    assert rank.attributes is not None and rank.attributes["relaygr.cache.outcome"] == "hbm_hit"
    [link] = rank.links
    assert link.attributes is not None and link.attributes["relaygr.relay.producer"] == "pre_infer"
    prefill = traced.one("ranker.prefill")
    assert prefill.parent is not None and prefill.parent.span_id == _ids(pre_infer)[1]
    assert prefill.attributes is not None
    assert prefill.attributes["relaygr.tokens.computed"] == TOKENS + 4
    assert prefill.attributes["relaygr.job.chunks"] == 2  # 64-token chunks
    [queue_b, queue_r] = sorted(traced.spans("ranker.queue"), key=lambda s: s.start_time or 0)
    assert queue_b.attributes is not None and queue_b.attributes["relaygr.priority"] == "background"
    assert queue_r.attributes is not None and queue_r.attributes["relaygr.priority"] == "rank"
    rank_compute = traced.one("ranker.rank")
    assert rank_compute.parent is not None and rank_compute.parent.span_id == _ids(rank)[1]
    assert queue_r.end_time == rank_compute.start_time  # the compute starts where the wait ends


async def test_dram_reload_keeps_the_producer_and_traces_the_tier_moves(
    traced: Traced, engine: RankerEngine, rng: np.random.Generator
) -> None:
    a = rank_input(rng, prefix(rng, TOKENS, user_id="a"))
    b = rank_input(rng, prefix(rng, TOKENS, user_id="b"))

    with traced.tracer.start_as_current_span("PreInfer a"):
        await engine.pre_infer(a.prefix, None, None)
    with traced.tracer.start_as_current_span("Rank a"):
        await engine.rank(a, None)  # consumed: a may now leave HBM
    with traced.tracer.start_as_current_span("PreInfer b"):
        await engine.pre_infer(b.prefix, None, None)  # demotes a to DRAM
    assert engine.store.tier_of(engine.key(a.prefix)) is Tier.DRAM
    with traced.tracer.start_as_current_span("Rank a again"):
        outcome = (await engine.rank(a, None)).outcome
    assert outcome is CacheOutcome.DRAM_HIT
    assert _link_of(traced.one("Rank a again")) == _ids(traced.one("PreInfer a"))
    demote = traced.one("ranker.demote")
    assert demote.parent is not None
    assert demote.parent.span_id == _ids(traced.one("PreInfer b"))[1]
    reload = traced.one("ranker.reload")
    assert reload.attributes is not None
    assert (reload.attributes["relaygr.kv.from"], reload.attributes["relaygr.kv.to"]) == (
        "dram",
        "hbm",
    )
    assert reload.attributes["relaygr.tokens.computed"] == 0


async def test_a_rank_waiting_for_its_pre_infer_links_to_it(
    traced: Traced, engine: RankerEngine, rng: np.random.Generator
) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="a"))
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(30)

    engine.worker.run(hold)
    await asyncio.to_thread(entered.wait, 30)

    async def pre_infer() -> None:
        with traced.tracer.start_as_current_span("PreInfer"):
            await engine.pre_infer(request.prefix, None, None)

    async def rank() -> CacheOutcome:
        with traced.tracer.start_as_current_span("Rank"):
            return (await engine.rank(request, None)).outcome

    pre = asyncio.create_task(pre_infer())
    await eventually(lambda: engine.inflight() == 1, "PreInfer queued behind the gate")
    ranked = asyncio.create_task(rank())
    promoted = lambda: any(e.kind == "promoted" for e in engine.queues.events)  # noqa: E731
    await eventually(promoted, "the Rank joined the PreInfer's job")
    release.set()
    await pre
    outcome = await ranked
    assert outcome is CacheOutcome.WAITED_INFLIGHT
    assert _link_of(traced.one("Rank")) == _ids(traced.one("PreInfer"))
    wait = traced.one("ranker.wait_inflight")
    assert wait.parent is not None and wait.parent.span_id == _ids(traced.one("Rank"))[1]


async def test_a_miss_has_no_link_and_a_return_visit_links_to_the_rank_that_computed_it(
    traced: Traced, engine: RankerEngine, rng: np.random.Generator
) -> None:
    p = prefix(rng, TOKENS, user_id="a")

    outcomes = []
    for name in ("Rank 1", "Rank 2"):
        with traced.tracer.start_as_current_span(name):
            outcomes.append((await engine.rank(rank_input(rng, p), None)).outcome)
    assert outcomes == [CacheOutcome.MISS, CacheOutcome.HBM_HIT]
    first, second = traced.one("Rank 1"), traced.one("Rank 2")
    assert _link_of(first) is None
    assert _link_of(second) == _ids(first)
    [link] = second.links
    assert link.attributes is not None and link.attributes["relaygr.relay.producer"] == "rank"


async def test_without_a_tracer_nothing_is_recorded_and_nothing_changes(
    traced: Traced, rng: np.random.Generator
) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="a"))

    for engine in _engine(None, hbm_entries=1.5):
        with traced.tracer.start_as_current_span("PreInfer"):  # a sampled caller, even so
            await engine.pre_infer(request.prefix, None, None)
        with traced.tracer.start_as_current_span("Rank"):
            outcome = (await engine.rank(request, None)).outcome
        assert outcome is CacheOutcome.HBM_HIT
        entry = engine.store.peek(engine.key(request.prefix), Tier.HBM)
        assert entry is not None and entry.origin is None
        assert isinstance(entry.kv, PrefixKV)
    assert sorted(s.name for s in traced.exporter.get_finished_spans()) == ["PreInfer", "Rank"]
    assert not traced.one("Rank").links


async def test_a_batched_rank_carries_its_calls_size_on_its_spans(
    traced: Traced, rng: np.random.Generator
) -> None:
    """Ranks queued together run as one call: each Rank's span and its compute span say how
    many Ranks shared the call and how many rows it put through; a Rank alone, a call of one."""
    users = ("a", "b", "c")
    requests = [
        rank_input(rng, prefix(rng, TOKENS, user_id=u), int(rng.integers(1, 17)),
                   int(rng.integers(1, 33)))
        for u in users
    ]  # fmt: skip
    rows = sum(len(r.short_term) + len(r.candidates) for r in requests)
    # batch_backlog=1: the queued Ranks share a call whatever they save (`batching.BatchRoom`)
    for engine in _engine(traced.tracer, hbm_entries=len(users) + 1, batch_backlog=1):
        await _ranked_together(traced, engine, users, requests)
        with traced.tracer.start_as_current_span("Rank alone"):
            assert (await engine.rank(requests[0], None)).outcome is CacheOutcome.HBM_HIT
    computes = {s.parent.span_id: s for s in traced.spans("ranker.rank") if s.parent}
    for u in users:
        span = traced.one(f"Rank {u}")
        for s in (span, computes[_ids(span)[1]]):
            assert s.attributes is not None
            assert s.attributes["relaygr.batch.requests"] == 3
            assert s.attributes["relaygr.batch.rows"] == rows
    r = requests[0]
    alone = traced.one("Rank alone")
    for s in (alone, computes[_ids(alone)[1]]):
        assert s.attributes is not None
        assert s.attributes["relaygr.batch.requests"] == 1
        assert s.attributes["relaygr.batch.rows"] == len(r.short_term) + len(r.candidates)


async def _ranked_together(
    traced: Traced, engine: RankerEngine, users: tuple[str, ...], requests: list[RankInput]
) -> None:
    """Each user's prefix pre-inferred, then their Ranks (spans "Rank <user>") queued while a
    gate holds the worker, then let through: one batched call."""
    for r in requests:
        await engine.pre_infer(r.prefix, None, None)
    gate = Gate(engine)
    await gate.wait_entered()

    async def rank(name: str, request: RankInput) -> CacheOutcome:
        with traced.tracer.start_as_current_span(name):
            return (await engine.rank(request, None)).outcome

    tasks = [
        asyncio.create_task(rank(f"Rank {u}", r)) for u, r in zip(users, requests, strict=True)
    ]
    await eventually(lambda: engine.queues.depth(Priority.RANK) == len(users), "Ranks queued")
    gate.open()
    assert await asyncio.gather(*tasks) == [CacheOutcome.HBM_HIT] * len(users)
