"""Workload generator and trace files: seeded, open-loop schedule, JSON Lines round trip."""

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from relaygr.errors import InvalidInput
from tooling.local.workload import (
    T0,
    Population,
    WorkloadSpec,
    distinct_users,
    poisson_arrivals,
    read_trace,
    write_trace,
    zipf_ranks,
)


def test_a_seed_reproduces_the_schedule_and_requests() -> None:
    def draw() -> list[tuple[float, str, int]]:
        population = Population(WorkloadSpec(users=50), np.random.default_rng(5))
        return [
            (a.at, a.request.prefix.user_id, len(a.request.prefix.long_term))
            for a in poisson_arrivals(population, 10.0, 5.0)
        ]

    first = draw()
    assert first == draw()
    assert 20 < len(first) < 100  # ~50 arrivals at 10/s over 5 s
    assert all(0 <= t < 5.0 for t, _, _ in first)
    assert [t for t, _, _ in first] == sorted(t for t, _, _ in first)


def test_return_visits_reuse_or_extend_the_users_history(rng: np.random.Generator) -> None:
    # Three users, so every later visit returns; short first histories and no session burn-in,
    # so no user reaches the length cap, where a return cannot grow.
    spec = WorkloadSpec(users=3, new_behaviours_p=0.5, median_long_term=100, revisit_p=0.0)
    population = Population(spec, rng)
    seen: dict[str, np.ndarray] = {}
    grew = 0
    for arrival in poisson_arrivals(population, 20.0, 5.0):
        request = arrival.request
        p = request.prefix
        earlier = seen.get(p.user_id)
        if earlier is not None:  # the old history is exactly a prefix of the new one
            assert np.array_equal(p.long_term.records()[: len(earlier)], earlier)
            grew += len(p.long_term) > len(earlier)
        seen[p.user_id] = p.long_term.records()
        assert spec.min_long_term <= len(p.long_term) <= spec.max_long_term
        assert len(request.candidates) == spec.candidates
        # Time never goes back: long-term, then short-term, then the request itself.
        times = np.concatenate([p.long_term.timestamps, request.short_term.timestamps])
        assert np.all(np.diff(times) >= 0) and times[-1] <= request.request_ts
    assert grew > 0  # some return visits brought new behaviours


def test_a_user_is_the_same_whoever_visits_around_it(rng: np.random.Generator) -> None:
    """User k's history derives from (seed, k) alone: not from the order users are drawn in."""
    seed = int(rng.integers(2**32))
    a = Population(WorkloadSpec(users=10**6), np.random.default_rng(seed))
    b = Population(WorkloadSpec(users=10**6), np.random.default_rng(seed))
    for user in (12345, 7, 999_999):
        b.history(int(rng.integers(10**6)), T0)  # b sees other users first
        pa, pb = a.history(user, T0), b.history(user, T0)
        assert pa.user_id == pb.user_id
        assert np.array_equal(pa.long_term.records(), pb.long_term.records())
        assert np.array_equal(pa.user_features, pb.user_features)


def test_ten_million_users_cost_only_the_visits_drawn() -> None:
    """10^7 users: nothing is materialised; 5,000 visits stay under 16 MiB of generator state
    (histories are rebuilt on demand, so only visit times are kept) and a seed reproduces them.
    """
    spec = WorkloadSpec(users=10**7)

    def draw(seed: int) -> tuple[list[tuple[str, int, int]], int]:
        population = Population(spec, np.random.default_rng(seed))
        tracemalloc.start()
        try:
            out = []
            for i in range(5000):
                request = population.request(T0 + i)
                out.append((request.prefix.user_id, len(request.prefix.long_term), i))
                del request  # the caller keeps arrivals; the generator must not
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return out, peak

    first, peak = draw(11)
    assert peak < 16 * 2**20, f"generator peak {peak / 2**20:.1f} MiB"
    assert first == draw(11)[0]
    users = {u for u, _, _ in first}
    assert len(users) > 4000  # a large population: most visits are by distinct users
    lengths = np.array([n for _, n, _ in first])
    assert lengths.max() <= spec.max_long_term and lengths.min() >= spec.min_long_term
    # The length distribution is the stated one: median near the log-normal median, and the
    # cap holds the users above it (about 15% for the Yambda-derived default).
    assert abs(np.median(lengths) / spec.median_long_term - 1) < 0.1
    assert 0.10 < np.mean(lengths == spec.max_long_term) < 0.20


def test_zipf_ranks_follow_the_power_law_without_a_table(rng: np.random.Generator) -> None:
    users = 10**7
    draws = zipf_ranks(rng, users, 0.8, 200_000)
    assert draws.min() >= 0 and draws.max() < users
    # P(k < K) for the continuous law on [1, N + 1): ((K+1)^0.2 - 1) / ((N+1)^0.2 - 1).
    for k in (10, 1000, 100_000):
        expected = ((k + 1) ** 0.2 - 1) / ((users + 1) ** 0.2 - 1)
        assert abs(np.mean(draws < k) - expected) < 0.01


def test_sessions_bring_return_visits_at_the_stated_rate(rng: np.random.Generator) -> None:
    spec = WorkloadSpec(users=10**7, revisit_p=0.3, revisit_gap_s=5.0, max_long_term=256)
    arrivals = poisson_arrivals(Population(spec, rng), 20.0, 200.0)
    assert abs(len(arrivals) / 200.0 - 20.0) < 2.0  # returns included, visits average `rate`
    # ... from the start: the sessions began before 0, so a short window is not thin.
    early = sum(a.at < 10.0 for a in arrivals)
    assert abs(early / 10.0 - 20.0) < 5.0, early
    returns = 1 - distinct_users(arrivals) / len(arrivals)
    assert 0.2 < returns < 0.36  # ~revisit_p of visits are followed by a return in the window


def test_trace_round_trip(tmp_path: Path, rng: np.random.Generator) -> None:
    population = Population(WorkloadSpec(users=10, max_long_term=256), rng)
    arrivals = poisson_arrivals(population, 5.0, 3.0)
    path = tmp_path / "trace.jsonl"
    write_trace(arrivals, path)
    back = read_trace(path)
    assert len(back) == len(arrivals)
    for a, b in zip(arrivals, back, strict=True):
        assert a.at == b.at and a.request.prefix.user_id == b.request.prefix.user_id
        assert np.array_equal(
            a.request.prefix.long_term.timestamps, b.request.prefix.long_term.timestamps
        )
        assert np.array_equal(a.request.candidates, b.request.candidates)
        assert a.request.request_ts == b.request.request_ts


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("candidates"), "expected exactly the keys"),
        (lambda d: d.update(at=-1), "at must be a non-negative number"),
        (lambda d: d.update(user_id=""), "user_id must be a non-empty string"),
        (lambda d: d["long_term"]["actions"].pop(), "long_term"),
        (lambda d: d.update(ts="now"), "ts must be an integer"),
        (lambda d: d.update(candidates=[[1, 2]]), "candidates must be one-dimensional"),
    ],
)
def test_a_bad_trace_line_is_refused_with_its_line_number(
    tmp_path: Path, change: object, message: str
) -> None:
    good = {
        "at": 0.5, "user_id": "u", "user_features": [1],
        "long_term": {"item_ids": [1, 2], "actions": [0, 1], "timestamps": [10, 20]},
        "short_term": {"item_ids": [], "actions": [], "timestamps": []},
        "candidates": [7, 8], "ts": 30,
    }  # fmt: skip
    bad = json.loads(json.dumps(good))
    change(bad)  # type: ignore[operator]
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(InvalidInput, match=message) as err:
        read_trace(path)
    assert f"{path}:2" in str(err.value)


def test_out_of_order_arrivals_are_refused(tmp_path: Path) -> None:
    line = {
        "at": 1.0, "user_id": "u", "user_features": [],
        "long_term": {"item_ids": [1], "actions": [0], "timestamps": [1]},
        "short_term": {"item_ids": [], "actions": [], "timestamps": []},
        "candidates": [1], "ts": 2,
    }  # fmt: skip
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps({**line, "at": 0.5}) + "\n")
    with pytest.raises(InvalidInput, match="time order"):
        read_trace(path)
