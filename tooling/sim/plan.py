"""Capacity planning by search: the fewest rankers that meet a P99 SLO, then the least device
memory each needs, over an injected evaluator (`relaygr plan` gives it the simulator).

Two searches on integers, both assuming that more never hurts (more rankers, more device
memory): the ranker count by doubling from 1 until a count passes, then bisection between it and
the last that failed; at that count, the device tier on a grid of `memory_step_bytes`, by halving
from the profile's tier until one fails, then bisection. A size passes when every seed does.

A fleet of N rankers is simulated as a `Slice` of k = min(N, most) of them, with k/N of the load
and of the users (see `Slice`).
"""

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from relaygr.placement import ranking
from tooling.sim.ranker import MemoryUse
from tooling.sim.workload import Visit


@dataclass(frozen=True, slots=True)
class Run:
    """One simulated fleet size, device tier and seed, as the search judges it."""

    seed: int
    ranks: int  # Ranks counted (after the warm-up)
    failed: int  # of them, not answered OK
    p50_ms: float
    p99_ms: float
    hit_ratio: float
    relayed_ratio: float
    memory: MemoryUse  # the most one ranker's tiers held
    span_s: float  # simulated seconds of visits (the tiers start empty)

    def meets(self, slo_ms: float) -> bool:
        """P99 within the SLO and no failed Rank."""
        return self.failed == 0 and self.p99_ms <= slo_ms


# (rankers, device tier bytes per ranker, seed) -> what the simulation measured
Evaluate = Callable[[int, int, int], Run]
RunKey = tuple[int, int, int]  # an `Evaluate`'s arguments: (rankers, tier, seed)


class Runs(Protocol):
    """Many runs at once (`tooling.sim.processes.Processes`): up to `width` keys, whose runs
    come back in the order asked."""

    @property
    def width(self) -> int: ...

    def __call__(self, asks: Sequence[RunKey]) -> list[Run]: ...


@dataclass(frozen=True, slots=True)
class InTurn:
    """`Runs` one after another in this process: a trial asks its seeds one at a time and stops
    at the first that fails."""

    evaluate: Evaluate
    width: int = 1

    def __call__(self, asks: Sequence[RunKey]) -> list[Run]:
        return [self.evaluate(*ask) for ask in asks]


@dataclass(frozen=True, slots=True)
class Trial:
    """A fleet size and device tier judged over the seeds; the search stops at the first seed
    that fails, so `runs` may be fewer than the seeds unless every seed was asked for."""

    rankers: int
    device_tier_bytes: int
    runs: tuple[Run, ...]
    passed: bool

    @property
    def p50_ms(self) -> float:
        return max(r.p50_ms for r in self.runs)

    @property
    def p99_ms(self) -> float:
        """The worst seed's."""
        return max(r.p99_ms for r in self.runs)

    @property
    def failed(self) -> int:
        return sum(r.failed for r in self.runs)

    @property
    def ranks(self) -> int:
        return min(r.ranks for r in self.runs)

    @property
    def hit_ratio(self) -> float:
        return statistics.fmean(r.hit_ratio for r in self.runs)

    @property
    def relayed_ratio(self) -> float:
        return statistics.fmean(r.relayed_ratio for r in self.runs)

    @property
    def span_s(self) -> float:
        return min(r.span_s for r in self.runs)

    @property
    def memory(self) -> MemoryUse:
        """The most one ranker held on any seed, figure by figure."""
        peak = MemoryUse()
        for run in self.runs:
            peak = peak.peak(run.memory)
        return peak


@dataclass(frozen=True, slots=True)
class Goal:
    """What to plan for: the SLO, the seeds every size must pass, the device tier the memory
    search starts from (the profile's) and its grid, and where the ranker search gives up."""

    slo_ms: float
    seeds: tuple[int, ...]
    device_tier_bytes: int
    memory_step_bytes: int
    max_rankers: int

    def tier(self, units: int) -> int:
        """Grid point `units` of the memory search: that many steps, never above the top."""
        return min(units * self.memory_step_bytes, self.device_tier_bytes)

    @property
    def tier_units(self) -> int:
        """The grid point of the top tier."""
        return math.ceil(self.device_tier_bytes / self.memory_step_bytes)


@dataclass(frozen=True, slots=True)
class Plan:
    """The answer and what it is compared with, every seed run for each; `steps` is the search
    in the order it ran."""

    goal: Goal
    answer: Trial | None  # (fewest rankers, least device tier); None: none up to max_rankers
    at_top: Trial | None  # the same rankers with the top device tier
    fewer: Trial | None  # one ranker fewer, top tier (None for one ranker); max_rankers if none
    steps: tuple[Trial, ...]

    @property
    def rankers(self) -> int | None:
        return None if self.answer is None else self.answer.rankers


def fewest(passes: Callable[[int], bool], limit: int, above: int = 0) -> int | None:
    """The least n in (above, limit] with `passes(n)`, for `passes` false below some n and true
    from there (`above` known to fail): above + 1, 2, 4, ... until one passes, then bisection
    between it and the last that failed. None when `limit` fails too, or `above` reaches it."""
    if above >= limit:
        return None
    failed, step, n = above, 1, above + 1
    while not passes(n):
        if n >= limit:
            return None
        step *= 2
        failed, n = n, min(above + step, limit)
    return _bisect(passes, failed, n)


def least_below(passes: Callable[[int], bool], top: int) -> int:
    """The least i in [1, top] with `passes(i)`, given that `top` passes (it is not asked)
    and that `passes` is false below some i and true from there: top/2, top/4, ... until one
    fails, then bisection between it and the last that passed."""
    passed = top
    while passed > 1 and passes(passed // 2):
        passed //= 2
    return _bisect(passes, passed // 2, passed)


def _bisect(passes: Callable[[int], bool], failed: int, passed: int) -> int:
    """The least passing value in (failed, passed], `passed` passing."""
    while passed - failed > 1:
        middle = (failed + passed) // 2
        if passes(middle):
            passed = middle
        else:
            failed = middle
    return passed


def search(
    evaluate: Evaluate,
    goal: Goal,
    on_run: Callable[[int, int, Run], None] = lambda *_: None,
    above: int = 0,
    runs: Runs | None = None,
    known: Mapping[RunKey, Run] | None = None,
) -> Plan:
    """The fewest rankers (more than `above`, known too few) that pass at the top device tier,
    then the least tier that passes with that many; `evaluate` runs once per (rankers, tier,
    seed) at most, and never for a run `known` holds already; `on_run` hears each run.
    `runs`, where given, runs a trial's seeds `runs.width` at a time (the answer is the same: a
    trial still fails at its first failing seed, though the seeds beside it in its batch ran
    too)."""
    judge = _Judge(runs or InTurn(evaluate), goal, on_run, known or {})
    top = goal.device_tier_bytes
    rankers = fewest(lambda n: judge.trial(n, top).passed, goal.max_rankers, above)
    if rankers is None:
        largest = judge.trial(goal.max_rankers, top, every_seed=True)
        return Plan(goal, None, None, largest, tuple(judge.steps))
    units = least_below(lambda i: judge.trial(rankers, goal.tier(i)).passed, goal.tier_units)
    answer = judge.trial(rankers, goal.tier(units), every_seed=True)
    at_top = judge.trial(rankers, top, every_seed=True)
    fewer = judge.trial(rankers - 1, top, every_seed=True) if rankers > 1 else None
    return Plan(goal, answer, at_top, fewer, tuple(judge.steps))


def confirm(
    sliced: Plan,
    whole_at_answer: Sequence[Run],
    evaluate_whole: Evaluate,
    on_run: Callable[[int, int, Run], None] = lambda *_: None,
    runs: Runs | None = None,
) -> Plan | None:
    """The plan once the slice's answer is checked on the whole fleet (`whole_at_answer`: one
    run per seed there): None when the whole fleet meets the SLO on every seed (the sliced plan
    stands); else the search again with every fleet simulated whole (`evaluate_whole`), from the
    slice's answer at the top tier on: the slice's one ranker fewer is taken to fail (a slice
    errs low near capacity, where a fleet's P99 is set by its hottest rankers and a larger fleet
    has hotter ones: docs/simulator.md, "Planning a fleet"), which the plan's own row for one
    ranker fewer, simulated whole, then shows. The check's runs count in it: the search never
    simulates the slice's answer whole again."""
    assert sliced.answer is not None
    if all(run.meets(sliced.goal.slo_ms) for run in whole_at_answer):
        return None
    answer = sliced.answer
    known = {(answer.rankers, answer.device_tier_bytes, run.seed): run for run in whole_at_answer}
    return search(evaluate_whole, sliced.goal, on_run, answer.rankers - 1, runs, known)


class _Judge:
    """Trials from runs, each (rankers, tier, seed) evaluated once."""

    def __init__(
        self,
        runs: Runs,
        goal: Goal,
        on_run: Callable[[int, int, Run], None],
        known: Mapping[RunKey, Run],
    ) -> None:
        self._many = runs
        self._goal = goal
        self._on_run = on_run
        self._runs: dict[RunKey, Run] = dict(known)
        self.steps: list[Trial] = []

    def trial(self, rankers: int, tier: int, every_seed: bool = False) -> Trial:
        """The seeds judged in order, up to the first that fails (every seed: all of them);
        those not yet run are run `width` at a time."""
        slo, seeds = self._goal.slo_ms, self._goal.seeds
        runs: list[Run] = []
        for start in range(0, len(seeds), self._many.width):
            batch = [(rankers, tier, seed) for seed in seeds[start : start + self._many.width]]
            new = [ask for ask in batch if ask not in self._runs]
            for ask, run in zip(new, self._many(new), strict=True):
                self._runs[ask] = run
                self._on_run(rankers, tier, run)
            judged = [self._runs[ask] for ask in batch]
            failed = next((i for i, run in enumerate(judged) if not run.meets(slo)), None)
            if failed is not None and not every_seed:
                runs += judged[: failed + 1]
                break
            runs += judged
        passed = len(runs) == len(seeds) and all(r.meets(slo) for r in runs)
        trial = Trial(rankers, tier, tuple(runs), passed)
        if not every_seed:
            self.steps.append(trial)
        return trial


@dataclass(frozen=True, slots=True)
class Slice:
    """`rankers` of a fleet of `fleet`, standing in for all of it.

    Rendezvous hashing gives each user one owner, uniformly over the rankers, so k of N rankers
    serve k/N of the users and, on average, k/N of the load: the slice runs at that share of
    the rate over that share of the population. With Zipf-skewed visits (weight rank^-s,
    s < 1) the scaled population's per-user rates match those of the users the slice serves,
    up to the few most active ones.
    """

    rankers: int
    fleet: int

    @classmethod
    def of(cls, fleet: int, most: int) -> "Slice":
        return cls(min(fleet, most), fleet)

    @property
    def share(self) -> float:
        return self.rankers / self.fleet

    def rate(self, qps: float) -> float:
        return qps * self.share

    def users(self, users: int) -> int:
        return max(1, round(users * self.share))


def slice_trace(visits: Sequence[Visit], qps: float, part: Slice) -> list[Visit]:
    """A trace as the slice sees it: the visits of the users whose rendezvous owner among the
    fleet's rankers is one of the slice's, with time scaled so that the whole trace would run
    at `qps`."""
    if not visits:
        return []
    span = visits[-1].at
    scale = len(visits) / span / qps if span > 0 else 1.0
    names = [f"ranker-{i}" for i in range(part.fleet)]
    ours = set(names[: part.rankers])
    owned: dict[str, bool] = {}
    kept: list[Visit] = []
    for v in visits:
        mine = owned.get(v.user)
        if mine is None:
            mine = owned[v.user] = ranking(v.user, names)[0] in ours
        if mine:
            kept.append(
                Visit(
                    v.at * scale, v.user, v.user_features, v.behaviours, v.short_term, v.candidates
                )
            )
    return kept


def host_estimate(peak_bytes: int, run_s: float, ttl_s: float) -> int:
    """Host-tier bytes a ranker holds once the tier is in its steady state, from the peak of a
    run that started empty: entries leave after `ttl_s`, so a run shorter than that saw the
    tier still filling; assuming it fills at a steady rate, scale up to the TTL."""
    if run_s <= 0 or run_s >= ttl_s:
        return peak_bytes
    return math.ceil(peak_bytes * ttl_s / run_s)


def round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def default_step(device_tier_bytes: int) -> int:
    """The memory search's grid: the largest power of two of bytes at most 1/32 of the tier."""
    return 1 << max(0, (device_tier_bytes // 32).bit_length() - 1)
