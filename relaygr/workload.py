"""Synthetic relay workload: Zipf users, long-tailed histories, return visits, Poisson arrivals.

Pure: everything is drawn from the generator it is given, so a seed reproduces a run. Users can
replay their own traffic instead: `read_trace` / `write_trace` (docs/trace-format.md).
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from relaygr.errors import InvalidInput
from relaygr.ranker.inputs import Behaviours, Prefix, RankInput, UserId, as_int64
from relaygr.ranker.synthetic import random_behaviours

T0 = 1_700_000_000


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    users: int = 300  # active users in the window; Zipf makes a few of them return often
    zipf_s: float = 1.1
    median_long_term: int = 1024
    long_term_sigma: float = 0.8  # log-normal spread of history lengths: P99 ~6.5k, up to 8k
    min_long_term: int = 64
    max_long_term: int = 8192
    short_term: tuple[int, int] = (32, 128)
    candidates: int = 128
    user_features: int = 8
    # Retrieval -> ranking. Production gaps (~50-100 ms) are several times an accelerator's
    # prefill of a long prefix; on 2 CPU cores a 4k prefill takes ~0.4 s, so the gap is
    # scaled to keep that ratio.
    gap_s: float = 1.0
    new_behaviours_p: float = 0.3  # a return visit brings new long-term behaviours
    new_behaviours_max: int = 16
    user_prefix: str = "user"  # user ids are f"{user_prefix}-{k}"; distinct runs, distinct users


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the start: retrieval (PreInfer) time; Rank at at + gap
    request: RankInput


@dataclass(slots=True)
class Population:
    """Per-user state that persists across visits, so return visits reuse or extend prefixes."""

    spec: WorkloadSpec
    rng: np.random.Generator
    weights: np.ndarray = field(init=False)
    histories: dict[int, Prefix] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ranks = np.arange(1, self.spec.users + 1, dtype=np.float64)
        self.weights = ranks**-self.spec.zipf_s / np.sum(ranks**-self.spec.zipf_s)

    def _behaviours(self, n: int, start: int) -> Behaviours:
        return random_behaviours(self.rng, n, start, 3600)

    def _history(self, user: int, now: int) -> Prefix:
        spec = self.spec
        known = self.histories.get(user)
        if known is None:
            n = int(np.clip(
                self.rng.lognormal(np.log(spec.median_long_term), spec.long_term_sigma),
                spec.min_long_term, spec.max_long_term,
            ))  # fmt: skip
            known = Prefix(
                UserId(f"{spec.user_prefix}-{user}"),
                self.rng.integers(0, 1 << 40, spec.user_features),
                self._behaviours(n, now - 10**7),
            )
        elif self.rng.random() < spec.new_behaviours_p:
            room = spec.max_long_term - len(known.long_term)
            extra = min(int(self.rng.integers(1, spec.new_behaviours_max + 1)), room)
            if extra > 0:
                more = self._behaviours(extra, now - 3600)
                known = Prefix(known.user_id, known.user_features, known.long_term.concat(more))
        self.histories[user] = known
        return known

    def request(self, now: int) -> RankInput:
        user = int(self.rng.choice(self.spec.users, p=self.weights))
        prefix = self._history(user, now)
        low, high = self.spec.short_term
        short = self._behaviours(int(self.rng.integers(low, high + 1)), now - 600)
        candidates = self.rng.integers(0, 1 << 50, self.spec.candidates)
        return RankInput(prefix, short, candidates, now)


def poisson_arrivals(population: Population, rate: float, duration_s: float) -> list[Arrival]:
    """Open-loop schedule: exponential gaps at `rate` per second, fixed before anything is sent."""
    arrivals: list[Arrival] = []
    t = float(population.rng.exponential(1.0 / rate))
    while t < duration_s:
        arrivals.append(Arrival(t, population.request(T0 + int(t))))
        t += float(population.rng.exponential(1.0 / rate))
    return arrivals


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
