"""The simulator's requests: lengths, not behaviours.

A `Visit` is an arrival of the workload generator (`tooling.local.workload`) reduced to what
costs time and memory: who, how many user features, long-term and short-term behaviours, and
candidates. `visits_of` reduces the real arrivals (a trace file, or the generator's), so the
real mesh and the simulator can run the same trace; `light_visits` draws the same process
with the generator's own length draws, in bulk, and never builds a behaviour array: runs of
millions of requests over 10^8 users cost memory by the visits drawn, not by the population.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from tooling.local.workload import (
    Arrival,
    Follow,
    WorkloadSpec,
    burn_in_s,
    check_follow,
    first_length,
    follow_ups,
    new_behaviours,
    zipf_ranks,
)


@dataclass(frozen=True, slots=True)
class Visit:
    """A retrieval at `at` (seconds from the start) whose Rank follows `gap_s` later (None: the
    fleet's gap), unless it is never `ranked` (a no-show: filtered or abandoned)."""

    at: float
    user: str
    user_features: int
    behaviours: int  # long-term
    short_term: int
    candidates: int
    gap_s: float | None = None
    ranked: bool = True

    @property
    def prefix_tokens(self) -> int:
        return self.user_features + self.behaviours

    @property
    def history_tokens(self) -> int:
        return self.prefix_tokens + self.short_term


def visits_of(arrivals: Sequence[Arrival], follow: Follow | None = None) -> list[Visit]:
    """The simulator's view of real arrivals. `follow`: each arrival's gap to its Rank and
    whether a Rank follows (`tooling.local.workload.follow_ups`, as the mesh driver was given
    them); None: the fleet's gap, every one ranked."""
    n = len(arrivals)
    if follow is not None:
        check_follow(follow, n)
    gaps: Sequence[float | None] = [None] * n if follow is None else follow[0]
    ranked: Sequence[bool] = [True] * n if follow is None else follow[1]
    return [
        Visit(
            a.at,
            a.request.prefix.user_id,
            len(a.request.prefix.user_features),
            len(a.request.prefix.long_term),
            len(a.request.short_term),
            len(a.request.candidates),
            None if gap is None else float(gap),
            bool(rank),
        )
        for a, gap, rank in zip(arrivals, gaps, ranked, strict=True)
    ]


def light_visits(spec: WorkloadSpec, rate: float, duration_s: float, seed: int) -> list[Visit]:
    """Open-loop visits at `rate` per second for `duration_s`: the process of
    `tooling.local.workload.poisson_arrivals`, drawn in bulk and in lengths only.

    Sessions start as a Poisson process at rate * (1 - revisit_p) from `burn_in_s` before 0;
    each is a user drawn Zipf-wise and a chain of visits, each followed by another with
    `revisit_p` after an exponential gap. A user's first long-term length and each return
    visit's new behaviours come from the same per-user generators as the Population's (so a
    user's lengths match it for the same population seed). The draws of the arrival process
    are not the Population's, so the visits are the same process, not the same trace. Memory
    and time go with the visits drawn (burn-in included), never with the population. With a
    gap spread or no-shows in `spec`, each visit carries its own gap and whether it is ranked
    (`follow_ups`); without, the fleet's gap applies and every visit is ranked.
    """
    rng = np.random.default_rng(seed)
    population_seed = int(rng.integers(0, 2**63))
    start_rate = rate * (1.0 - spec.revisit_p)
    begin = -burn_in_s(spec)
    span = duration_s - begin
    # Session starts: a Poisson process on [begin, duration_s).
    count = int(rng.poisson(start_rate * span))
    starts = np.sort(rng.uniform(begin, duration_s, count))
    users = zipf_ranks(rng, spec.users, spec.zipf_s, count)
    visits = (
        rng.geometric(1.0 - spec.revisit_p, count)
        if spec.revisit_p > 0
        else np.ones(count, np.int64)
    )
    # Every visit's time: its session's start plus the gaps before it.
    session = np.repeat(np.arange(count), visits)
    gaps = rng.exponential(spec.revisit_gap_s, len(session))
    first = np.concatenate(([0], np.cumsum(visits)[:-1])) if count else np.zeros(0, np.int64)
    gaps[first] = 0.0
    elapsed = np.cumsum(gaps)
    elapsed -= np.repeat(elapsed[first], visits)
    times = starts[session] + elapsed
    who = users[session]
    keep = times < duration_s
    times, who = times[keep], who[keep]
    # Each visit's index among its user's visits (burn-in included), in time order.
    order = np.lexsort((times, who))
    ranked_users = who[order]
    new_user = (
        np.concatenate(([True], ranked_users[1:] != ranked_users[:-1]))
        if len(order)
        else np.zeros(0, bool)
    )
    group_start = np.maximum.accumulate(np.where(new_user, np.arange(len(order)), 0))
    index = np.empty(len(order), np.int64)
    index[order] = np.arange(len(order)) - group_start
    shown = np.flatnonzero(times >= 0)
    shown = shown[np.argsort(times[shown], kind="stable")]
    low, high = spec.short_term
    shorts = rng.integers(low, high + 1, len(shown))
    lengths = _Lengths(spec, population_seed)
    prefix = spec.user_prefix
    drawn = [
        Visit(
            float(times[i]),
            f"{prefix}-{int(who[i])}",
            spec.user_features,
            lengths.at(int(who[i]), int(index[i])),
            int(short),
            spec.candidates,
        )
        for i, short in zip(shown, shorts, strict=True)
    ]
    if spec.gap_sigma == 0 and spec.no_show_p == 0:
        return drawn
    gaps, ranked = follow_ups(spec, seed, len(drawn))
    return [
        replace(v, gap_s=float(g), ranked=bool(r))
        for v, g, r in zip(drawn, gaps, ranked, strict=True)
    ]


@dataclass(slots=True)
class _Lengths:
    """Users' long-term lengths by visit, from their own generators, computed once each."""

    spec: WorkloadSpec
    seed: int
    known: dict[int, list[int]] = field(default_factory=dict)  # user -> length at visit v

    def at(self, user: int, visit: int) -> int:
        lengths = self.known.get(user)
        if lengths is None:
            lengths = [first_length(np.random.default_rng((self.seed, user)), self.spec)]
            self.known[user] = lengths
        while len(lengths) <= visit:
            v = len(lengths)
            room = self.spec.max_long_term - lengths[-1]
            more = new_behaviours(np.random.default_rng((self.seed, user, v)), self.spec, room)
            lengths.append(lengths[-1] + more)
        return lengths[visit]
