"""A /metrics scrape reads the ranker's typed stats and changes nothing: relays past their window
are released by the engine's tick, not by whoever reads."""

import asyncio

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.ranker.handoff import HandoffStats
from services.ranker.handoff_grpc import HandoffReceiving
from services.ranker.kv_store import Tier
from services.ranker.metrics import RankerMetrics
from services.ranker.warm import Warm, Warming
from tests.helm.test_monitoring import named_metrics
from tests.unit.ranker.factories import prefix, rank_input
from tests.unit.ranker.test_engine import TOKENS, running_engine


def _pinned(text: str) -> float:
    for line in text.splitlines():
        if line.startswith('relaygr_ranker_kv_pinned_bytes{tier="hbm"}'):
            return float(line.split()[-1])
    raise AssertionError("no pinned bytes gauge")


def test_a_scrape_expires_nothing(rng: np.random.Generator) -> None:
    registry = CollectorRegistry()
    warming = Warming()
    RankerMetrics(registry, warming)
    with running_engine() as (engine, _):
        warming.ready(Warm(engine, "r", HandoffReceiving(HandoffStats(), max_streams=1)))
        asyncio.run(engine.pre_infer(prefix(rng, TOKENS, user_id="a"), 1.0, None))
        clock = engine.core.clock
        clock.now += 2.0  # type: ignore[attr-defined]  # past the relay window
        pinned = engine.stats().tiers[Tier.HBM].pinned_bytes
        assert pinned > 0
        for _ in range(2):
            assert _pinned(generate_latest(registry).decode()) == pinned
        assert engine.stats().kv.relays_expired_unconsumed == 0
        asyncio.run(_tick(engine))
        assert _pinned(generate_latest(registry).decode()) == 0


async def _tick(engine: object) -> None:
    engine.tick()  # type: ignore[attr-defined]


def test_every_ranker_metric_the_dashboard_and_alerts_name_is_exported() -> None:
    """A panel or alert naming a ranker series that no ranker exports (misspelt, renamed, a
    histogram read as a counter) fails here, without a Prometheus; the batching panels'
    histograms among them."""
    named = {n for n in named_metrics() if n.startswith("relaygr_ranker_")}
    assert {f"relaygr_ranker_batch_{m}_bucket" for m in ("requests", "rows")} <= named
    registry = CollectorRegistry()
    warming = Warming()
    RankerMetrics(registry, warming)
    with running_engine() as (engine, _):
        warming.ready(Warm(engine, "r", HandoffReceiving(HandoffStats(), max_streams=1)))
        exported = {sample.name for family in registry.collect() for sample in family.samples}
    assert named - exported == set()


def _gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[-1])
    return None


def test_the_relay_wait_tail_is_exported_once_20_relays_were_timed(
    rng: np.random.Generator,
) -> None:
    registry = CollectorRegistry()
    warming = Warming()
    RankerMetrics(registry, warming)
    tail = "relaygr_ranker_relay_wait_p99_seconds"
    with running_engine() as (engine, _):
        warming.ready(Warm(engine, "r", HandoffReceiving(HandoffStats(), max_streams=1)))
        clock = engine.core.clock

        async def relay(user: str, wait_s: float) -> None:
            request = rank_input(rng, prefix(rng, TOKENS, user_id=user), 2, 2)
            await engine.pre_infer(request.prefix, 60.0, None)
            clock.now += wait_s  # type: ignore[attr-defined]
            await engine.rank(request, None)

        for i in range(19):
            asyncio.run(relay(f"u{i}", 0.01))
        assert _gauge(generate_latest(registry).decode(), tail) is None  # too few to tell
        asyncio.run(relay("u19", 0.25))
        assert _gauge(generate_latest(registry).decode(), tail) == pytest.approx(0.25)  # longest
