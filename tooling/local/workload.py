"""Synthetic relay workload: a large Zipf population, sessions of return visits, open-loop arrivals.

Pure and lazy: a user's history is derived on demand from the population seed and the user's
index, so a population of 10^7 users costs nothing until they visit; the only state is, per user
who has visited, how many visits it has made and when (bounded by the arrivals drawn, not by the
population). Users can replay their own traffic instead: `read_trace` / `write_trace`
(docs/trace-format.md).

History lengths (the long-term behaviours a ranking request carries) follow a log-normal whose
mean matches Yambda-5B, a public industrial recommendation log: 4.79e9 events from 1e6 users
(Yandex Music; dataset card and arXiv 2505.22238), so 4,790 events per user. The card publishes
the mean, not the spread: sigma = 1.0 is our assumption (per-user activity in such logs spans
orders of magnitude). Lengths are truncated at the serving model's maximum (8,192 behaviours
here), so about 15% of users sit at the cap, as heavy users do in production.
"""

import heapq
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from relaygr.behaviours import Behaviours, Prefix, RankInput, UserId, as_int64
from relaygr.errors import InvalidInput
from services.ranker.synthetic import DEFAULT_ACTIONS, ITEM_ID_BITS

T0 = 1_700_000_000
HISTORY_SPAN_S = 10**7  # a first-seen user's long-term behaviours lie in the ~4 months before T0

# Yambda-5B: 4.79e9 events / 1e6 users (see the module docstring); sigma is our assumption.
YAMBDA_MEAN_EVENTS_PER_USER = 4790
DEFAULT_LONG_TERM_SIGMA = 1.0


def lognormal_median(mean: float, sigma: float) -> int:
    """The median of a log-normal with this mean and sigma (mean = median * exp(sigma^2 / 2))."""
    return round(mean / math.exp(sigma**2 / 2))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A user population and how it visits. Rates are set by the caller of `poisson_arrivals`.

    Visits come in sessions: a session starts with a Zipf-chosen user (active users start more
    sessions) and each visit is followed by another of the same session with `revisit_p`, an
    exponential `revisit_gap_s` later; a return visit brings new long-term behaviours with
    `new_behaviours_p`. Cross-visit cache reuse follows from these and from the tiers' size: it
    is measured by the benchmarks, never set.
    """

    users: int = 1_000_000
    zipf_s: float = 0.8  # skew of session starts over users (rank k has weight k^-s)
    median_long_term: int = lognormal_median(YAMBDA_MEAN_EVENTS_PER_USER, DEFAULT_LONG_TERM_SIGMA)
    long_term_sigma: float = DEFAULT_LONG_TERM_SIGMA
    min_long_term: int = 64
    max_long_term: int = 8192  # the serving model's maximum long-term length
    short_term: tuple[int, int] = (32, 128)
    candidates: int = 128
    user_features: int = 8
    # Retrieval -> ranking. In production the gap (tens of ms to ~100 ms) is of the order of
    # the ranking budget and of an accelerator's prefill of a long history; benchmarks scale
    # it with the model's cost on the machine at hand. `gap_s` is the median; each visit's gap
    # is log-normal around it with `gap_sigma` (0, the default: every gap is `gap_s`). An
    # assumption: no public per-request figure for the gap's spread was found; a log-normal
    # is the usual shape of a service's latency, and the intermediate stages (pre-ranking,
    # filtering) between retrieval and ranking are such latencies.
    gap_s: float = 1.0
    gap_sigma: float = 0.0
    # The share of retrievals never followed by a Rank (filtered out by the stages between, or
    # abandoned by the user); which ones is not known at retrieval time. Default 0, an
    # assumption (no public figure found): a relay for such a visit is pure waste.
    no_show_p: float = 0.0
    revisit_p: float = 0.3  # a visit is followed by another in the same session
    revisit_gap_s: float = 30.0  # mean seconds between visits of a session
    new_behaviours_p: float = 0.3  # a return visit brings new long-term behaviours
    new_behaviours_max: int = 16
    user_prefix: str = "user"  # user ids are f"{user_prefix}-{k}"; distinct runs, distinct users

    def __post_init__(self) -> None:
        if self.users < 1:
            raise InvalidInput(f"users must be >= 1, got {self.users}")
        if not 0 <= self.revisit_p < 1:
            raise InvalidInput(f"revisit_p must be in [0, 1), got {self.revisit_p}")
        if not 0 < self.min_long_term <= self.max_long_term:
            raise InvalidInput("need 0 < min_long_term <= max_long_term")
        if not 0 <= self.no_show_p < 1:
            raise InvalidInput(f"no_show_p must be in [0, 1), got {self.no_show_p}")
        if self.gap_sigma < 0:
            raise InvalidInput(f"gap_sigma must be >= 0, got {self.gap_sigma}")


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the start: retrieval (PreInfer) time; Rank at at + gap
    request: RankInput

    @property
    def prefix_tokens(self) -> int:
        return self.request.prefix.num_tokens


# Each arrival's gap to its Rank (seconds) and whether a Rank follows at all (`follow_ups`).
Follow = tuple[Sequence[float], Sequence[bool]]


def check_follow(follow: Follow, count: int) -> None:
    """ValueError unless `follow` gives one gap and one flag for each of `count` arrivals."""
    if len(follow[0]) != count or len(follow[1]) != count:
        raise ValueError(f"follow must give {count} gaps and {count} flags")


def follow_ups(spec: WorkloadSpec, seed: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """For `count` retrievals in order: each one's gap to its Rank (seconds, log-normal with
    median `gap_s` and sigma `gap_sigma`) and whether a Rank follows at all (with probability
    1 - `no_show_p`). Drawn from their own generator of `seed`, so that the arrivals' other
    draws do not change with these knobs, and the same for every variant of a run."""
    rng = np.random.default_rng((seed, 0x6A7))
    gaps = spec.gap_s * np.exp(spec.gap_sigma * rng.standard_normal(count))
    ranked = rng.random(count) >= spec.no_show_p
    return gaps, ranked


def zipf_ranks(rng: np.random.Generator, users: int, s: float, size: int) -> np.ndarray:
    """`size` user indices in [0, users), index k drawn with weight ~ (k + 1)^-s.

    Inverse-CDF sampling of the continuous power law on [1, users + 1), floored: O(size) time
    and memory whatever the population (a discrete table would hold `users` weights)."""
    u = rng.random(size)
    if abs(s - 1.0) < 1e-9:
        x = np.exp(u * math.log(users + 1.0))
    else:
        a = 1.0 - s
        x = (1.0 + u * ((users + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, users - 1)


def _sorted_times(rng: np.random.Generator, n: int, low: int, high: int) -> np.ndarray:
    return np.sort(rng.integers(low, max(high, low + 1), n))


def _behaviours(rng: np.random.Generator, n: int, low: int, high: int) -> Behaviours:
    """`n` behaviours with random items and actions, times sorted in [low, high)."""
    return Behaviours.of(
        rng.integers(0, 1 << ITEM_ID_BITS, n),
        rng.integers(1, DEFAULT_ACTIONS, n),
        _sorted_times(rng, n, low, high),
    )


def first_length(rng: np.random.Generator, spec: WorkloadSpec) -> int:
    """A first-seen user's long-term length: the first draw of the user's own generator."""
    return int(np.clip(
        rng.lognormal(math.log(spec.median_long_term), spec.long_term_sigma),
        spec.min_long_term, spec.max_long_term,
    ))  # fmt: skip


def new_behaviours(rng: np.random.Generator, spec: WorkloadSpec, room: int) -> int:
    """How many long-term behaviours a return visit brings (at most `room`): the first draws
    of the visit's own generator."""
    if room <= 0 or rng.random() >= spec.new_behaviours_p:
        return 0
    return min(int(rng.integers(1, spec.new_behaviours_max + 1)), room)


@dataclass(slots=True)
class _Seen:
    """A visited user's visit times (Unix seconds): all its later histories derive from them."""

    times: list[int]


@dataclass(slots=True)
class Population:
    """A lazily derived population: user k's first history comes from (seed, k), its visit v's
    new behaviours from (seed, k, v), so a user is the same whichever users visit around it.

    `rng` draws the arrival process (who starts a session, when, short-term behaviours,
    candidates) and, once, the population seed. Memory: one small record per user seen.
    """

    spec: WorkloadSpec
    rng: np.random.Generator
    seed: int = field(init=False)
    seen: dict[int, _Seen] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.seed = int(self.rng.integers(0, 2**63))

    def user_id(self, user: int) -> UserId:
        return UserId(f"{self.spec.user_prefix}-{user}")

    def _first_history(self, user: int) -> tuple[np.ndarray, Behaviours]:
        spec = self.spec
        rng = np.random.default_rng((self.seed, user))
        n = first_length(rng, spec)
        features = rng.integers(0, 1 << 40, spec.user_features)
        return features, _behaviours(rng, n, T0 - HISTORY_SPAN_S, T0 - HISTORY_SPAN_S // 2)

    def _new_behaviours(self, user: int, visit: int, room: int, low: int, high: int) -> Behaviours:
        rng = np.random.default_rng((self.seed, user, visit))
        n = new_behaviours(rng, self.spec, room)
        return _behaviours(rng, n, low, high) if n else Behaviours.empty()

    def history(self, user: int, now: int) -> Prefix:
        """User `user`'s prefix at a visit at `now` (Unix seconds, not before its last visit).

        Visit v's new behaviours derive from (seed, user, v) and the visit times alone, so a
        return visit's history extends (or repeats) the previous one exactly."""
        features, long_term = self._first_history(user)
        state = self.seen.setdefault(user, _Seen([]))
        state.times.append(now)
        for visit, at in enumerate(state.times[1:], start=1):
            low = int(long_term.timestamps[-1])
            room = self.spec.max_long_term - len(long_term)
            more = self._new_behaviours(user, visit, room, low, max(low, at - 60))
            if len(more):
                long_term = long_term.concat(more)
        return Prefix(self.user_id(user), features, long_term)

    def visit(self, user: int, now: int) -> RankInput:
        prefix = self.history(user, now)
        low, high = self.spec.short_term
        since = max(int(prefix.long_term.timestamps[-1]), now - 60)
        short = _behaviours(self.rng, int(self.rng.integers(low, high + 1)), since, now + 1)
        candidates = self.rng.integers(0, 1 << ITEM_ID_BITS, self.spec.candidates)
        return RankInput(prefix, short, candidates, now)

    def request(self, now: int) -> RankInput:
        """A visit by a Zipf-chosen user (a session start)."""
        user = int(zipf_ranks(self.rng, self.spec.users, self.spec.zipf_s, 1)[0])
        return self.visit(user, now)


def poisson_arrivals(population: Population, rate: float, duration_s: float) -> list[Arrival]:
    """Open-loop schedule of `rate` visits per second for `duration_s`, fixed before anything
    is sent: sessions start as a Poisson process at rate * (1 - revisit_p) (so that visits,
    returns included, average `rate`), each visit followed by a return with `revisit_p`.

    The session process starts `burn_in_s(spec)` before 0, so returns of earlier sessions are
    due from the first second and the visit rate is `rate` throughout, not only once sessions
    have built up. Visits before 0 still advance their users' histories."""
    spec, rng = population.spec, population.rng
    start_rate = rate * (1.0 - spec.revisit_p)
    pending: list[tuple[float, int, int]] = []  # (time, tie-breaker, user) of return visits
    arrivals: list[Arrival] = []
    t = -burn_in_s(spec) + float(rng.exponential(1.0 / start_rate))
    order = 0
    while True:
        if pending and pending[0][0] <= t:
            at, _, user = heapq.heappop(pending)
        elif t < duration_s:
            at, user = t, int(zipf_ranks(rng, spec.users, spec.zipf_s, 1)[0])
            t += float(rng.exponential(1.0 / start_rate))
        elif pending and pending[0][0] < duration_s:
            at, _, user = heapq.heappop(pending)
        else:
            break
        if at >= 0:
            arrivals.append(Arrival(at, population.visit(user, T0 + int(at))))
        else:
            population.history(user, T0 + int(at))
        if rng.random() < spec.revisit_p:
            order += 1
            heapq.heappush(pending, (at + float(rng.exponential(spec.revisit_gap_s)), order, user))
    return arrivals


def burn_in_s(spec: WorkloadSpec) -> float:
    """How long before 0 sessions start: long enough that all but ~1% of the returns due in
    the window come from sessions it contains (a session of k visits spans k gaps)."""
    if spec.revisit_p == 0:
        return 0.0
    return 5.0 * spec.revisit_gap_s / (1.0 - spec.revisit_p)


def distinct_users(arrivals: Iterable[Arrival]) -> int:
    return len({a.request.prefix.user_id for a in arrivals})


# Trace files: JSON Lines, one arrival per line, in time order (see docs/trace-format.md).
TRACE_FIELDS = ("at", "user_id", "user_features", "long_term", "short_term", "candidates", "ts")


def _behaviours_json(b: Behaviours) -> dict[str, list[int]]:
    return {
        "item_ids": b.item_ids.tolist(),
        "actions": b.actions.tolist(),
        "timestamps": b.timestamps.tolist(),
    }


def _behaviours_from(raw: object, what: str) -> Behaviours:
    if not isinstance(raw, dict) or set(raw) != {"item_ids", "actions", "timestamps"}:
        raise InvalidInput(f"{what} must be an object with item_ids, actions, timestamps")
    try:
        return Behaviours.of(raw["item_ids"], raw["actions"], raw["timestamps"], what=what)
    except InvalidInput as err:
        raise InvalidInput(f"{what}: {err}") from err


def write_trace(arrivals: Iterable[Arrival], path: Path) -> None:
    with path.open("w") as out:
        for a in arrivals:
            r = a.request
            line = {
                "at": a.at,
                "user_id": r.prefix.user_id,
                "user_features": r.prefix.user_features.tolist(),
                "long_term": _behaviours_json(r.prefix.long_term),
                "short_term": _behaviours_json(r.short_term),
                "candidates": r.candidates.tolist(),
                "ts": r.request_ts,
            }
            out.write(json.dumps(line, separators=(",", ":")) + "\n")


def read_trace(path: Path) -> list[Arrival]:
    """Arrivals from a JSON Lines trace; InvalidInput names the line and field at fault."""
    arrivals: list[Arrival] = []
    with path.open() as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                raw = json.loads(text)
                if not isinstance(raw, dict) or sorted(raw) != sorted(TRACE_FIELDS):
                    raise InvalidInput(f"expected exactly the keys {list(TRACE_FIELDS)}")
                at = raw["at"]
                if isinstance(at, bool) or not isinstance(at, int | float) or not at >= 0:
                    raise InvalidInput(f"at must be a non-negative number of seconds, got {at!r}")
                if arrivals and at < arrivals[-1].at:
                    raise InvalidInput("arrivals must be in time order")
                if not isinstance(raw["user_id"], str) or not raw["user_id"]:
                    raise InvalidInput("user_id must be a non-empty string")
                if isinstance(raw["ts"], bool) or not isinstance(raw["ts"], int):
                    raise InvalidInput("ts must be an integer (Unix seconds)")
                prefix = Prefix(
                    UserId(raw["user_id"]),
                    as_int64(raw["user_features"], "user_features"),
                    _behaviours_from(raw["long_term"], "long_term"),
                )
                request = RankInput(
                    prefix,
                    _behaviours_from(raw["short_term"], "short_term"),
                    as_int64(raw["candidates"], "candidates"),
                    raw["ts"],
                )
            except (json.JSONDecodeError, InvalidInput) as err:
                raise InvalidInput(f"{where}: {err}") from err
            arrivals.append(Arrival(float(at), request))
    return arrivals
