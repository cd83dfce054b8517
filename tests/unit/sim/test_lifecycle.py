"""Fleet changes in the simulator run the ranker's own drain and fetch: a draining ranker hands its
prefixes off while still registered, and a rolling restart misses less with hand-off and peer
fetch on than off (the direction of the mesh's lifecycle benchmark)."""

import random
from collections import Counter

import pytest

from services.ranker.config import RankerConfig
from services.trigger.config import Mode, TriggerConfig
from tests.unit.sim.test_agreement import PROFILE
from tooling.local.workload import WorkloadSpec
from tooling.sim.events import EventLoop
from tooling.sim.fleet import Fleet, FleetSettings
from tooling.sim.membership import FleetEvent, schedule
from tooling.sim.workload import light_visits

SPEC = WorkloadSpec(
    users=60, median_long_term=80, long_term_sigma=0.5, min_long_term=16, max_long_term=200,
    short_term=(4, 8), candidates=8, user_features=4, gap_s=0.2, revisit_p=0.9,
    revisit_gap_s=2.0, new_behaviours_p=0.0,
)  # fmt: skip


def settings(lifecycle: bool, rankers: int = 3) -> FleetSettings:
    ranker = RankerConfig(
        plaintext=True, handoff=lifecycle, peer_fetch=lifecycle, prefill_chunk_tokens=64,
        relay_window_ms=1000,
    )  # fmt: skip
    trigger = TriggerConfig(
        plaintext=True, mode=Mode.OFF, slo_ms=40.0, margin_ms=10.0, expected_gap_ms=200.0,
        relay_window_ms=1000,
    )  # fmt: skip
    return FleetSettings(rankers=rankers, ranker=ranker, trigger=trigger, gap_s=SPEC.gap_s)


def seed() -> int:
    drawn = random.SystemRandom().randrange(2**32)
    print(f"seed {drawn}")
    return drawn


def test_a_draining_ranker_hands_off_before_it_leaves() -> None:
    loop = EventLoop()
    fleet = Fleet(loop, PROFILE, settings(True), seed())
    for index, visit in enumerate(light_visits(SPEC, 20.0, 10.0, seed=7)):
        fleet.visit(index, visit)
    loop.run(until=10.0)
    leaving = fleet.rankers["ranker-0"]
    held = [c.key for c in leaving.handoff_order()]
    assert held, "the trace left prefixes on ranker-0"
    began = loop.now
    fleet.drain("ranker-0")
    # Registered, serving its users, until its receivers hold what it sent.
    while "ranker-0" in fleet.live():
        stats = fleet.stats
        assert stats.handed_off + stats.handoff_declined + stats.handoff_unsent <= len(held)
        loop.run(until=loop.now + 0.001)
    stats = fleet.stats
    # The time it stayed registered, draining, is counted (sizing reads it beside the writes).
    assert 0 < stats.draining_s <= loop.now - began
    assert stats.draining_s > loop.now - began - 0.001
    assert stats.handed_off > 0
    assert stats.handed_off + stats.handoff_declined + stats.handoff_unsent == len(held)
    others = [r for name, r in fleet.rankers.items() if name != "ranker-0"]
    received = [k for k in held if any(r.held_for_peer(k) is not None for r in others)]
    assert len(received) >= stats.handed_off


def misses_after(lifecycle: bool, event: str, run_seed: int) -> int:
    loop = EventLoop()
    fleet = Fleet(loop, PROFILE, settings(lifecycle), run_seed)
    for index, visit in enumerate(light_visits(SPEC, 30.0, 40.0, seed=run_seed)):
        fleet.visit(index, visit)
    schedule(fleet, FleetEvent.parse(event))
    loop.run(until=80.0)  # the observers tick for ever: stop well after the last Rank
    records = fleet.finished()
    assert all(r.status == "OK" for r in records)
    outcomes = Counter(r.outcome for r in records if r.at >= 15.0)
    print(event, "lifecycle" if lifecycle else "plain", dict(outcomes))
    return outcomes["miss"]


@pytest.mark.parametrize("event", ["15:rolling-restart:4", "15:scale-out:3"])
def test_hand_off_and_peer_fetch_cut_the_misses_of_a_fleet_change(event: str) -> None:
    run_seed = seed()
    assert misses_after(True, event, run_seed) < misses_after(False, event, run_seed)
