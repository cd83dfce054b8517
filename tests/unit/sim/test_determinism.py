"""A simulation is a function of its inputs: one seed, one result."""

import random
from dataclasses import replace

from services.trigger.config import TriggerConfig
from tests.unit.sim.test_agreement import PROFILE
from tooling.local.workload import WorkloadSpec
from tooling.sim.fleet import FleetSettings, run_visits
from tooling.sim.workload import light_visits

SPEC = WorkloadSpec(users=10_000, median_long_term=120, max_long_term=400, gap_s=1.0)


def run(seed: int) -> list[tuple[object, ...]]:
    noisy = replace(PROFILE, compute_noise=0.2)  # the noise is drawn from the seed too
    cfg = FleetSettings(rankers=3, trigger=TriggerConfig(plaintext=True, slo_ms=40.0))
    records, _ = run_visits(noisy, cfg, light_visits(SPEC, 20.0, 20.0, seed), seed)
    return [(r.latency_s, r.outcome, r.instance, r.decision) for r in records]


def test_same_seed_same_run_other_seed_other_run() -> None:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    first = run(seed)
    assert len(first) > 200
    assert run(seed) == first
    assert run(seed + 1) != first
