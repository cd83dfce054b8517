"""Workload generator and trace files: seeded, open-loop schedule, JSON Lines round trip."""

import json
from pathlib import Path

import numpy as np
import pytest

from relaygr.errors import InvalidInput
from relaygr.workload import Population, WorkloadSpec, poisson_arrivals, read_trace, write_trace


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
    spec = WorkloadSpec(users=3, new_behaviours_p=0.5)
    population = Population(spec, rng)
    seen: dict[str, np.ndarray] = {}
    for arrival in poisson_arrivals(population, 20.0, 5.0):
        p = arrival.request.prefix
        earlier = seen.get(p.user_id)
        if earlier is not None:  # the old history is a prefix of the new one
            assert np.array_equal(p.long_term.item_ids[: len(earlier)], earlier)
        seen[p.user_id] = p.long_term.item_ids
        assert spec.min_long_term <= len(p.long_term) <= spec.max_long_term
        assert len(arrival.request.candidates) == spec.candidates


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
