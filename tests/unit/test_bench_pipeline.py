"""The mesh benchmarks' points send the workload's no-shows and gaps, and the simulator's replay
of them keeps both: a `--no-show` run that ranked every retrieval measured something else."""

import argparse
from typing import Any

import numpy as np
import pytest

import bench.pipeline as pipeline
from bench.report import rotated
from tooling.local.drive import Point
from tooling.local.workload import Arrival, WorkloadSpec, poisson_arrivals
from tooling.sim.workload import visits_of

SPEC = WorkloadSpec(users=10_000, gap_s=0.2, gap_sigma=0.5, no_show_p=0.4)


def test_a_point_drives_the_populations_no_shows_and_gaps(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run_point` hands the driver each arrival's own gap and whether a Rank follows, as the
    workload draws them; and every variant of a seed gets the same ones."""
    seed = int(rng.integers(0, 2**31))
    driven: list[dict[str, Any]] = []

    def drive_mesh(mesh: object, mode: str, arrivals: list[object], **kw: Any) -> Point:
        driven.append({"arrivals": arrivals, **kw})
        return Point.of(kw["label"], kw["rate"], arrivals, [], 0.0)

    monkeypatch.setattr(pipeline, "drive_mesh", drive_mesh)
    args = argparse.Namespace(duration=60.0, min_requests=1, warmup=0.2, timeout=5.0, min_ranks=0)
    ran: list[pipeline.Ran] = []
    for label in ("relay all", "relay sequence-aware"):
        variant = pipeline.Variant(label, mesh=None, mode="all")  # type: ignore[arg-type]
        pipeline.run_point(variant, pipeline.population(label, SPEC, seed), 4.0, args, ran)

    first, second = (d["follow"] for d in driven)
    gaps, ranked = first
    assert len(gaps) == len(ranked) == len(driven[0]["arrivals"]) > 100
    assert 0.25 < 1 - np.mean(ranked) < 0.55  # no_show_p 0.4
    assert np.std(np.log(gaps)) == pytest.approx(0.5, abs=0.15)  # gap_sigma 0.5
    n = min(len(gaps), len(second[0]))  # each copy's schedule is the same draws
    assert list(ranked[:n]) == list(second[1][:n])
    assert [r.follow for r in ran] == [first, second]


def _drawn(arrivals: list[Arrival]) -> list[tuple[float, str, int]]:
    return [(a.at, a.request.prefix.user_id, a.prefix_tokens) for a in arrivals]


def test_a_point_counts_at_least_min_ranks_past_its_warmup_whatever_the_draw(
    rng: np.random.Generator,
) -> None:
    """At a duration whose mean count is the minimum, about half the draws count fewer Ranks
    (no-shows and the warm-up not counted); the schedule runs those on until they count it, and
    is then what one run of that longer duration draws (leaving the population as that run
    would). A draw that counts enough is left as it is."""
    rate, duration, warmup_s, minimum = 2.0, 50.0, 10.0, 48  # 2/s x 40 s x 60% ranked
    extended = 0
    for _ in range(12):
        seed = int(rng.integers(0, 2**31))
        population = pipeline.population("x", SPEC, seed)
        arrivals = pipeline.schedule(population, rate, duration, warmup_s, minimum)
        counted = pipeline.counted_ranks(population, arrivals, warmup_s)
        assert counted >= minimum, seed
        plain = pipeline.population("x", SPEC, seed)
        if arrivals[-1].at < duration and _drawn(arrivals) == _drawn(
            poisson_arrivals(plain, rate, duration)
        ):
            continue  # counted enough at the duration asked for
        extended += 1
        assert arrivals[-1].at < 1.5 * duration, seed  # on for about as long as it takes
        plain = pipeline.population("x", SPEC, seed)
        one_run = poisson_arrivals(plain, rate, arrivals[-1].at + 1e-9)
        assert _drawn(one_run) == _drawn(arrivals), seed
        assert plain.rng.random() == population.rng.random(), seed  # the same draws since
    assert extended > 0


def test_the_simulators_replay_keeps_each_arrivals_gap_and_no_show(
    rng: np.random.Generator,
) -> None:
    population = pipeline.population("x", SPEC, int(rng.integers(0, 2**31)))
    arrivals = poisson_arrivals(population, 4.0, 30.0)
    gaps, ranked = pipeline.follow_of(population, arrivals)
    visits = visits_of(arrivals, (gaps, ranked))
    assert [v.ranked for v in visits] == list(ranked)
    assert [v.gap_s for v in visits] == list(gaps)
    assert not all(ranked)
    plain = visits_of(arrivals)
    assert all(v.ranked and v.gap_s is None for v in plain)  # the fleet's gap, all ranked
    with pytest.raises(ValueError, match="gaps"):
        visits_of(arrivals, (gaps[1:], ranked[1:]))


def test_each_round_starts_with_the_next_variant_and_keeps_them_all() -> None:
    """The sweep's order at each rate: every variant once, the first moving on by one a round,
    so the host's drift falls on each alike."""
    variants = ["a", "b", "c"]
    orders = [rotated(variants, i) for i in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert rotated([], 5) == []
