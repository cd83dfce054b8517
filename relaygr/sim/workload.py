"""The simulator's requests: lengths, not behaviours.

A `Visit` is an arrival of the workload generator (`relaygr.local.workload`) reduced to what
costs time and memory: who, how many user features, long-term and short-term behaviours, and
candidates. `visits_of` reduces the real arrivals (a trace file, or the generator's), so the
real mesh and the simulator can run the same trace; `LightPopulation` draws the same process
with the generator's own length draws but never builds a behaviour array, for runs of millions
of requests over 10^8 users (its memory: two ints per user who has visited).
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from relaygr.local.workload import (
    Arrival,
    WorkloadSpec,
    first_length,
    new_behaviours,
    poisson_visits,
    zipf_ranks,
)


@dataclass(frozen=True, slots=True)
class Visit:
    """A retrieval at `at` (seconds from the start) whose Rank follows `gap` later."""

    at: float
    user: str
    user_features: int
    behaviours: int  # long-term
    short_term: int
    candidates: int

    @property
    def prefix_tokens(self) -> int:
        return self.user_features + self.behaviours

    @property
    def history_tokens(self) -> int:
        return self.prefix_tokens + self.short_term


def visits_of(arrivals: Iterable[Arrival]) -> list[Visit]:
    """The simulator's view of real arrivals."""
    return [
        Visit(
            a.at,
            a.request.prefix.user_id,
            len(a.request.prefix.user_features),
            len(a.request.prefix.long_term),
            len(a.request.short_term),
            len(a.request.candidates),
        )
        for a in arrivals
    ]


@dataclass(slots=True)
class _Lengths:
    behaviours: int
    visits: int  # visits so far, the first included


@dataclass(slots=True)
class LightPopulation:
    """`relaygr.local.workload.Population`'s process with lengths only.

    A user's first length and each return visit's new behaviours come from the same per-user
    generators as the Population's, so a user's lengths match it for the same population seed;
    short-term lengths are drawn from `rng` as it draws them, but no behaviour is built, so the
    arrival draws that follow are not the Population's.
    """

    spec: WorkloadSpec
    rng: np.random.Generator
    seed: int = field(init=False)
    seen: dict[int, _Lengths] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.seed = int(self.rng.integers(0, 2**63))

    def history(self, user: int, now: int) -> int:
        """The user's long-term length at a visit (now is unused: lengths need no times)."""
        state = self.seen.get(user)
        if state is None:
            length = first_length(np.random.default_rng((self.seed, user)), self.spec)
            self.seen[user] = _Lengths(length, 1)
            return length
        room = self.spec.max_long_term - state.behaviours
        more = new_behaviours(
            np.random.default_rng((self.seed, user, state.visits)), self.spec, room
        )
        state.behaviours += more
        state.visits += 1
        return state.behaviours

    def visit(self, user: int, now: int) -> tuple[int, int, int]:
        """(user, long-term, short-term) of a visit."""
        low, high = self.spec.short_term
        behaviours = self.history(user, now)
        return user, behaviours, int(self.rng.integers(low, high + 1))

    def request(self) -> int:
        return int(zipf_ranks(self.rng, self.spec.users, self.spec.zipf_s, 1)[0])


def light_visits(spec: WorkloadSpec, rate: float, duration_s: float, seed: int) -> list[Visit]:
    """Open-loop visits at `rate` per second for `duration_s` (`poisson_visits`), lengths only."""
    population = LightPopulation(spec, np.random.default_rng(seed))
    prefix = spec.user_prefix
    return [
        Visit(at, f"{prefix}-{user}", spec.user_features, long_term, short, spec.candidates)
        for at, (user, long_term, short) in poisson_visits(population, rate, duration_s)
    ]
