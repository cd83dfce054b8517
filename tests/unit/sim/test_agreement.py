"""One event sequence through the services' engine and through the simulator decides alike.

The fleet's wiring (the real `AdmissionPolicy` and `Forwarder`) runs the same trace twice: once
with the simulator's rankers, once with real `RankerEngine`s (a tiny model computing real
prefixes, the real store and scheduler on a virtual clock) behind an adapter. Visits are spaced so
that each request finishes before the next event: what may differ is only how long things take,
never what is decided. Admission reasons, PreInfer placements and outcomes, and each Rank's cache
outcome and ranker must be identical.
"""

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from relaygr.cost import CostModel
from relaygr.errors import RelayGRError
from relaygr.local.workload import Arrival, Population, WorkloadSpec, poisson_arrivals
from relaygr.room import RoomReport
from relaygr.sim.fleet import Fleet, FleetSettings, run_visits
from relaygr.sim.profile import DeviceProfile
from relaygr.sim.ranker import MemoryUse, PreInferReply, RankReply, Status, status_of
from relaygr.sim.workload import Visit, visits_of
from services.ranker.config import RankerConfig
from services.ranker.engine import Executor, RankerEngine
from services.ranker.kv_store import KVStore, Tier
from services.ranker.model import RankingModel
from services.ranker.queues import Job
from services.trigger.config import Mode, TriggerConfig
from tests.unit.ranker.factories import tiny_config

MODEL = RankingModel(tiny_config(), seed=11)
BYTES_PER_TOKEN = MODEL.cfg.cache_bytes_per_token
# Full inference of ~100 history tokens is at risk of the 40 ms SLO (margin 10 ms); reloading a
# host copy is cheaper than recomputing it.
COST = CostModel(
    fixed_ms=1.0, per_token_ms=0.3, per_pair_ms=1e-5, per_candidate_key_ms=1e-4,
    reload_ms_per_mb=0.01,
)  # fmt: skip
PROFILE = DeviceProfile(
    name="agreement",
    cost=COST,
    device_tier_bytes=200 * BYTES_PER_TOKEN,  # a few prefixes: demotions and refusals happen
    host_tier_bytes=900 * BYTES_PER_TOKEN,
    kv_bytes_per_token=BYTES_PER_TOKEN,
)
SPEC = WorkloadSpec(
    users=40, median_long_term=70, long_term_sigma=0.8, min_long_term=8, max_long_term=240,
    short_term=(4, 8), candidates=8, user_features=4, new_behaviours_p=0.5,
    new_behaviours_max=16, gap_s=1.0,
)  # fmt: skip
SPACING_S = 2.0  # between retrievals: every request ends long before the next event

VARIANTS = {
    "relay sequence-aware": (Mode.SEQUENCE_AWARE, True),
    "relay all": (Mode.ALL, True),
    "cache only": (Mode.OFF, True),
    "no cache": (Mode.OFF, False),
}


class Clock:
    """An engine's clock: the fleet's time, plus what its own compute steps took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def catch_up(self, now: float) -> None:
        self.now = max(self.now, now)


def virtual_steps(clock: Clock) -> Executor:
    def run(job: Job, step: Callable[[], Any]) -> Any:
        clock.now += job.next_step_ms / 1e3
        return step()

    return run


@dataclass(eq=False)
class EngineRanker:
    """A real `RankerEngine` behind the fleet's ranker interface; each call runs to its end."""

    instance_id: str
    fleet: Fleet
    requests: dict[Visit, Arrival]
    aio: asyncio.AbstractEventLoop
    alive: bool = True
    draining: bool = False
    busy_s: float = 0.0

    def __post_init__(self) -> None:
        self.clock = Clock()
        store = KVStore(
            PROFILE.device_tier_bytes, PROFILE.host_tier_bytes, 600.0, self.clock,
            lambda kv: kv.to("cpu"),
        )  # fmt: skip
        self.engine = RankerEngine(
            MODEL, store, COST, self.fleet.settings.ranker.core_settings(), clock=self.clock,
            executor=virtual_steps(self.clock),
        )  # fmt: skip

    def room(self) -> RoomReport:
        usage = self.engine.store.usage(Tier.HBM)
        queued = self.engine.queues.queued_background_ms()
        return RoomReport(usage.pinned_bytes, usage.budget_bytes, queued)

    def memory(self) -> MemoryUse:
        store = self.engine.store
        device, host = store.usage(Tier.HBM), store.usage(Tier.DRAM)
        return MemoryUse(device.used_bytes, device.pinned_bytes, host.used_bytes)

    def pre_infer(
        self,
        visit: Visit,
        window_s: float,
        rank_in_s: float | None,
        deadline: float | None,
        reply: Callable[[PreInferReply], None],
    ) -> None:
        self.clock.catch_up(self.fleet.loop.now)
        prefix = self.requests[visit].request.prefix
        try:
            done = self.aio.run_until_complete(
                self.engine.pre_infer(prefix, window_s, deadline, rank_in_s)
            )
        except RelayGRError as err:
            reply(PreInferReply(status_of(err)))
            return
        reply(PreInferReply(Status.OK, done.outcome, done.nbytes))

    def rank(
        self, visit: Visit, deadline: float | None, reply: Callable[[RankReply], None]
    ) -> None:
        self.clock.catch_up(self.fleet.loop.now)
        try:
            done = self.aio.run_until_complete(
                self.engine.rank(self.requests[visit].request, deadline)
            )
        except RelayGRError as err:
            reply(RankReply(status_of(err)))
            return
        reply(RankReply(Status.OK, done.outcome, done.computed_tokens, done.relayed))

    def kill(self) -> None:
        self.alive = False

    def stop(self) -> None:
        self.engine.stop()


@pytest.fixture
def trace() -> Iterator[list[Arrival]]:
    seed = random.SystemRandom().randrange(2**32)
    print(f"trace seed {seed}")
    drawn = poisson_arrivals(Population(SPEC, np.random.default_rng(seed)), 0.5, 90.0)
    yield [Arrival(0.3 + SPACING_S * i, a.request) for i, a in enumerate(drawn)]


def settings(mode: Mode, relay_enabled: bool) -> FleetSettings:
    return FleetSettings(
        rankers=2,
        ranker=RankerConfig(plaintext=True, relay_enabled=relay_enabled, prefill_chunk_tokens=64),
        trigger=TriggerConfig(
            plaintext=True,
            mode=mode,
            slo_ms=40.0,
            margin_ms=10.0,
            expected_gap_ms=1000.0,
            relay_window_ms=1500,
        ),
        gap_s=SPEC.gap_s,
    )


def decisions(fleet: Fleet, records: list) -> list[tuple[object, ...]]:
    return [
        (r.decision, fleet.relays_served.get(r.index), r.status, r.outcome, r.instance)
        for r in records
    ]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_engine_and_simulator_decide_alike(variant: str, trace: list[Arrival]) -> None:
    mode, relay_enabled = VARIANTS[variant]
    visits = visits_of(trace)
    cfg = settings(mode, relay_enabled)
    sim_records, sim_fleet = run_visits(PROFILE, cfg, visits, seed=1)
    requests = dict(zip(visits, trace, strict=True))
    aio = asyncio.new_event_loop()
    engines: list[EngineRanker] = []

    def make(instance: str, fleet: Fleet) -> EngineRanker:
        engines.append(EngineRanker(instance, fleet, requests, aio))
        return engines[-1]

    try:
        real_records, real_fleet = run_visits(PROFILE, cfg, visits, seed=1, make_ranker=make)
    finally:
        for engine in engines:
            engine.stop()
        aio.close()

    simulated, real = decisions(sim_fleet, sim_records), decisions(real_fleet, real_records)
    for index, (s, r) in enumerate(zip(simulated, real, strict=True)):
        assert s == r, f"arrival {index}: simulator {s} vs engine {r}"
    # The trace exercised what it is meant to compare.
    outcomes = Counter(r.outcome for r in real_records)
    reasons = Counter(r.decision for r in real_records)
    print(variant, dict(outcomes), dict(reasons))
    assert all(r.status == "OK" for r in real_records)
    if relay_enabled:
        assert outcomes["hbm_hit"]
    if mode is not Mode.ALL and relay_enabled:
        assert outcomes["miss"]
    if mode is Mode.SEQUENCE_AWARE:
        assert reasons["admitted"] and reasons["not_at_risk"]
