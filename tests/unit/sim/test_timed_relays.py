"""Timed relays in the simulator: the fleet's dispatcher holds a relay until the policy's send
time (`earliest_gap_ms`), and the relay still serves its Rank."""

import random
import statistics
from dataclasses import replace
from typing import Any

import pytest

from relaygr.cost import CostModel
from services.trigger.config import Mode, TriggerConfig
from tooling.local.workload import WorkloadSpec
from tooling.sim.fleet import Fleet, FleetSettings, run_visits, sim_ranker
from tooling.sim.profile import DeviceProfile
from tooling.sim.workload import Visit, light_visits

GAP_S = 0.5
SPEC = WorkloadSpec(users=5000, median_long_term=120, max_long_term=400, candidates=32, gap_s=GAP_S)
COST = CostModel(
    fixed_ms=1.0, per_token_ms=0.05, per_pair_ms=1e-5, per_candidate_key_ms=1e-4,
    reload_ms_per_mb=0.01,
)  # fmt: skip
# Room for every relay: only the timing differs between the runs compared.
PROFILE = DeviceProfile("timed", COST, 10**10, 10**11, kv_bytes_per_token=1024)


class Recording:
    """A simulated ranker that notes when each PreInfer reaches it, after its retrieval."""

    def __init__(self, instance: str, fleet: Fleet, waited: list[float]) -> None:
        self._ranker = sim_ranker(instance, fleet)
        self._fleet, self._waited = fleet, waited

    def pre_infer(self, visit: Visit, *args: Any) -> None:
        self._waited.append(self._fleet.loop.now - visit.at)
        self._ranker.pre_infer(visit, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ranker, name)


def run(earliest_ms: float, seed: int) -> tuple[list[float], float]:
    """Each PreInfer's time from its retrieval to its ranker, and the share of Ranks relayed."""
    trigger = TriggerConfig(
        plaintext=True, mode=Mode.ALL, expected_gap_ms=GAP_S * 1e3, earliest_gap_ms=earliest_ms
    )
    settings = FleetSettings(rankers=2, trigger=trigger, gap_s=GAP_S)
    waited: list[float] = []
    visits = light_visits(SPEC, 5.0, 10.0, seed)
    records, _ = run_visits(PROFILE, settings, visits, seed, lambda i, f: Recording(i, f, waited))  # type: ignore[arg-type, return-value]
    ranked = [r for r in records if r.status == "OK"]
    return waited, sum(r.relayed for r in ranked) / len(ranked)


@pytest.mark.parametrize("earliest_ms", [300.0, 450.0])
def test_a_timed_relay_reaches_its_ranker_late_and_still_serves_its_rank(
    earliest_ms: float,
) -> None:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    at_once, relayed_at_once = run(0.0, seed)
    timed, relayed_timed = run(earliest_ms, seed)
    assert timed and at_once
    assert max(at_once) < 0.05  # two hops
    prefill_s = COST.prefill_ms(SPEC.max_long_term + 64) / 1e3  # the longest prefix's, at most
    # Sent at its time: the earliest gap less its prefill and the work queued ahead of it
    # (little at this load, none for most).
    assert statistics.median(timed) >= earliest_ms / 1e3 - prefill_s - 0.02
    assert max(timed) <= earliest_ms / 1e3 + 0.01
    assert relayed_timed == pytest.approx(relayed_at_once, abs=0.05) and relayed_timed > 0.8


def test_relays_held_for_their_time_count_against_the_dispatch_queue() -> None:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    trigger = TriggerConfig(
        plaintext=True, mode=Mode.ALL, expected_gap_ms=500.0, earliest_gap_ms=450.0,
        dispatch_queue=3,
    )  # fmt: skip
    settings = FleetSettings(rankers=2, trigger=trigger, gap_s=GAP_S)
    visits = light_visits(replace(SPEC, users=10**6), 40.0, 3.0, seed)  # ~18 held at a time
    _, fleet = run_visits(PROFILE, settings, visits, seed)
    assert fleet.stats.dispatch_dropped > 0
