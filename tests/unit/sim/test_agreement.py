"""The service's driver and the simulator's driver of the one ranker core act alike.

The fleet's wiring (the real `AdmissionPolicy` and `Forwarder`) runs the same trace twice: once
with the simulator's rankers (`SimRanker`: sizes, profile times), once with real `RankerEngine`s
(a tiny model computing real prefixes on a compute thread, on a virtual clock) behind an adapter.
Visits are spaced so that each request finishes before the next event: what may differ is only
how long things take. Each ranker's core records every action it asks of its driver; the two
runs' action logs (the steps run, in order and at what priority; fetches; waits; every answer)
must be identical, and so must the admission reasons, placements and outcomes. The drivers share
the core, so this can only fail if a driver feeds it differently: it cannot drift.
"""

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from relaygr.cost import CostModel
from relaygr.errors import RelayGRError
from relaygr.room import RoomReport
from services.ranker.config import RankerConfig
from services.ranker.core_types import (
    Action,
    Answer,
    PreInferAnswer,
    RankAnswer,
    RunBatch,
    RunStep,
    StartFetch,
    Waited,
)
from services.ranker.engine import Executor, RankerEngine
from services.ranker.kv_store import KVStore, Tier
from services.ranker.model import RankingModel
from services.ranker.queues import Job
from services.trigger.config import Mode, TriggerConfig
from tests.unit.ranker.factories import tiny_config
from tooling.local.workload import Arrival, Population, WorkloadSpec, poisson_arrivals
from tooling.sim.fleet import Fleet, FleetSettings, run_visits
from tooling.sim.profile import DeviceProfile
from tooling.sim.ranker import (
    MemoryUse,
    PreInferReply,
    RankReply,
    SimRanker,
    Status,
    status_of,
)
from tooling.sim.workload import Visit, visits_of

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


def normal(action: Action) -> tuple[object, ...]:
    """An action as both drivers' cores must have asked it (payloads and digests aside)."""
    if isinstance(action, RunStep):
        job = action.job
        return ("step", job.name, job.steps_run, job.priority.name, type(job.spec).__name__)
    if isinstance(action, RunBatch):
        return ("batch", *(normal(RunStep(job)) for job in action.jobs))
    if isinstance(action, StartFetch):
        return ("fetch", action.key.user_id, action.peers, action.nbytes)
    if isinstance(action, Waited):
        return ("waited", action.request)
    assert isinstance(action, Answer)
    if action.error is not None:
        return ("answer", action.request, type(action.error).__name__)
    result = action.result
    if isinstance(result, PreInferAnswer):
        return ("answer", action.request, result.outcome, result.tokens, result.nbytes)
    assert isinstance(result, RankAnswer)
    return ("answer", action.request, result.outcome, result.computed_tokens, result.relayed)


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

    log: list[tuple[object, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clock = Clock()
        store = KVStore(
            PROFILE.device_tier_bytes, PROFILE.host_tier_bytes, 600.0, self.clock,
            lambda kv: kv.to("cpu"),
        )  # fmt: skip
        self.engine = RankerEngine(
            MODEL, store, COST, self.fleet.settings.ranker.core_settings(), clock=self.clock,
            executor=virtual_steps(self.clock), record=lambda a: self.log.append(normal(a)),
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
def trace(rng: np.random.Generator) -> Iterator[list[Arrival]]:
    drawn = poisson_arrivals(Population(SPEC, rng), 0.5, 90.0)  # reproducible: RELAYGR_SEED
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
            relay_spare_share=0.0,  # only what is at risk: the trace's relays are those
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
    sim_logs: dict[str, list[tuple[object, ...]]] = {}

    def make_sim(instance: str, fleet: Fleet) -> SimRanker:
        log = sim_logs.setdefault(instance, [])
        return SimRanker(
            instance, fleet.loop, PROFILE, cfg.ranker.core_settings(), cfg.ranker.dram_ttl_s,
            random.Random(0), record=lambda a: log.append(normal(a)),
        )  # fmt: skip

    sim_records, sim_fleet = run_visits(PROFILE, cfg, visits, seed=1, make_ranker=make_sim)
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

    for engine in engines:
        simulated_log = sim_logs[engine.instance_id]
        for i, (s, r) in enumerate(zip(simulated_log, engine.log, strict=True)):
            assert s == r, f"{engine.instance_id} action {i}: simulator {s} vs engine {r}"
    assert sum(len(e.log) for e in engines) > len(visits)  # the cores did act
    simulated, real = decisions(sim_fleet, sim_records), decisions(real_fleet, real_records)
    for index, (s, r) in enumerate(zip(simulated, real, strict=True)):
        assert s == r, f"arrival {index}: simulator {s} vs engine {r}"
    # The trace exercised what it is meant to compare.
    outcomes = Counter(r.outcome for r in real_records)
    reasons = Counter(r.decision for r in real_records)
    print(variant, dict(outcomes), dict(reasons))
    assert all(r.status == "OK" for r in real_records)
    if relay_enabled:  # prefixes were reused: relayed ones land in HBM, earlier visits' anywhere
        reused = ("hbm_hit",) if mode is not Mode.OFF else ("hbm_hit", "dram_hit", "extended")
        assert sum(outcomes[o] for o in reused), outcomes
    if mode is not Mode.ALL and relay_enabled:
        assert outcomes["miss"]
    if mode is Mode.SEQUENCE_AWARE:  # the trigger judged both ways: at risk, and not
        assert reasons["admitted"] and reasons["not_at_risk"] + reasons["spare"], reasons
