"""Workload realism knobs: the retrieval-to-ranking gap as a distribution and retrievals never
ranked (no-shows), drawn once for every variant of a run, and what the fleet makes of them."""

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from relaygr.errors import InvalidInput
from services.trigger.config import Mode
from tests.unit.sim.test_agreement import PROFILE
from tooling.local.drive import NO_RANK, OK
from tooling.local.workload import WorkloadSpec, follow_ups
from tooling.sim.fleet import ORACLE_NO_SHOW, FleetSettings, run_visits
from tooling.sim.profile import write_profile
from tooling.sim.simulate import parser, profile_of, workload_of
from tooling.sim.sweep import SweepSpec, run_sweep
from tooling.sim.workload import light_visits

SPEC = WorkloadSpec(users=5000, median_long_term=120, max_long_term=400, candidates=32, gap_s=0.5)


def seed() -> int:
    drawn = random.SystemRandom().randrange(2**32)
    print(f"seed {drawn}")
    return drawn


def test_gaps_are_lognormal_around_the_median_and_no_shows_come_at_their_share() -> None:
    s = seed()
    spec = WorkloadSpec(gap_s=0.1, gap_sigma=0.5, no_show_p=0.3)
    gaps, ranked = follow_ups(spec, s, 20_000)
    assert np.median(gaps) == pytest.approx(0.1, rel=0.03)
    assert np.std(np.log(gaps)) == pytest.approx(0.5, rel=0.03)
    assert 1 - ranked.mean() == pytest.approx(0.3, abs=0.015)
    # Degenerate: sigma 0 is the fixed gap, share 0 ranks every retrieval.
    gaps, ranked = follow_ups(WorkloadSpec(gap_s=0.1), s, 100)
    assert (gaps == 0.1).all() and ranked.all()


def test_the_knobs_leave_the_arrivals_as_they_were() -> None:
    s = seed()
    plain = light_visits(SPEC, 20.0, 10.0, s)
    spread = light_visits(replace(SPEC, gap_sigma=0.7, no_show_p=0.2), 20.0, 10.0, s)
    assert [(v.at, v.user, v.behaviours) for v in plain] == [
        (v.at, v.user, v.behaviours) for v in spread
    ]
    assert all(v.gap_s is None and v.ranked for v in plain)  # the fleet's gap, all ranked
    assert len({v.gap_s for v in spread}) > 1 and not all(v.ranked for v in spread)


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"no_show_p": 1.0}, "no_show_p must be in"), ({"gap_sigma": -0.1}, "gap_sigma must be")],
)
def test_bad_knobs_are_refused(changes: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        WorkloadSpec(**changes)


def test_a_no_show_is_never_ranked_nor_counted_but_its_relay_is_still_sent() -> None:
    s = seed()
    workload = replace(SPEC, no_show_p=0.4, gap_sigma=0.3)
    spec = SweepSpec(
        PROFILE, FleetSettings(rankers=2, gap_s=0.5), workload, (10.0,), 20.0, (s,),
        variants=("relay all",),
    )  # fmt: skip
    visits = light_visits(workload, 10.0, 20.0, s)
    (done,) = run_sweep(spec).points
    point = done.point
    counted = [v for v in visits if v.at >= 20.0 * spec.warmup]
    shows = sum(v.ranked for v in counted)
    assert 0 < shows < len(counted)
    assert point.sent == shows and point.ok == shows and not point.errors
    # The trigger cannot tell a no-show: relay all admits every retrieval's relay.
    assert sum(point.reasons.values()) == len(counted)
    assert NO_RANK not in point.errors


def test_simulate_takes_the_knobs_from_its_command_line(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    write_profile(replace(PROFILE, utilisation=0.25), path)
    args = parser().parse_args(
        ["--profile", str(path), "--gap-ms", "50", "--gap-sigma", "0.5", "--no-show", "0.1",
         "--utilisation", "0.5"]
    )  # fmt: skip
    workload = workload_of(args)
    assert (workload.gap_s, workload.gap_sigma, workload.no_show_p) == (0.05, 0.5, 0.1)
    profile = profile_of(args)
    assert profile.utilisation == 0.5
    assert profile.cost.per_token_ms == PROFILE.cost.per_token_ms / 2


def test_a_trigger_told_the_no_shows_never_sees_them_and_still_decides_the_ranked() -> None:
    s = seed()
    workload = replace(SPEC, no_show_p=0.4)
    visits = light_visits(workload, 10.0, 20.0, s)
    fleet = FleetSettings(rankers=2, gap_s=0.5)
    fleet = replace(fleet, trigger=replace(fleet.trigger, mode=Mode.ALL))
    plain, _ = run_visits(PROFILE, fleet, visits, s)
    told, _ = run_visits(PROFILE, replace(fleet, no_show_oracle=True), visits, s)
    shows = [i for i, v in enumerate(visits) if v.ranked]
    hidden = [i for i, v in enumerate(visits) if not v.ranked]
    assert shows and hidden
    # Shown them, relay all relays no-shows as any retrieval (a repeat visit's may be in flight).
    assert ORACLE_NO_SHOW not in {plain[i].decision for i in hidden}
    assert sum(plain[i].admitted for i in hidden) > len(hidden) / 2
    for i in hidden:
        assert (told[i].decision, told[i].admitted, told[i].status) == (
            ORACLE_NO_SHOW, False, NO_RANK,
        )  # fmt: skip
    for i in shows:  # decided by the trigger (a repeat visit may be in flight), then ranked
        assert told[i].decision != ORACLE_NO_SHOW and told[i].status == OK
    assert sum(told[i].admitted for i in shows) > len(shows) / 2
