"""The lifecycle benchmark's books: which runs a seed makes, the rankers' counters it scrapes at a
run's end (from real /metrics servers on loopback), and the table of misses it renders."""

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from bench.lifecycle_bench import (
    CHANGE_NAMES,
    CHANGES,
    CONTROL,
    ChangeRun,
    Missed,
    Settings,
    Window,
    missed_ranks,
    plan,
    ranker_counters,
    render,
)
from relaygr.behaviours import Behaviours, Prefix, RankInput, UserId
from relaygr.cost import CostModel
from tooling.local.drive import OK, RequestRecord
from tooling.local.workload import Arrival


def test_a_seed_runs_each_change_in_both_variants_and_the_control_with_only() -> None:
    even = plan(20261218, list(CHANGE_NAMES), ["without", "with"])
    assert even == [
        (CHANGES[0], "without"), (CHANGES[0], "with"),
        (CHANGES[1], "without"), (CHANGES[1], "with"),
        (CONTROL, "with"),
    ]  # fmt: skip
    odd = plan(20261219, list(CHANGE_NAMES), ["without", "with"])
    assert odd[:2] == [(CHANGES[0], "with"), (CHANGES[0], "without")]  # the other goes first


def test_changes_and_variants_narrow_the_runs() -> None:
    assert plan(1, ["restart"], ["with"]) == [(CHANGES[0], "with")]
    assert plan(2, ["control", "scale-out"], ["without"]) == [(CHANGES[1], "without")]


@pytest.fixture
def two_rankers() -> Iterator[list[str]]:
    """Two /metrics servers on loopback, each a ranker's registry with a few samples."""
    urls, servers = [], []
    for timeouts in (1, 2):
        registry = CollectorRegistry()
        fetch = Histogram("relaygr_ranker_fetch_seconds", "", ["result"], registry=registry)
        drops = Counter("relaygr_ranker_kv_drops", "", ["tier", "reason"], registry=registry)
        other = Counter("relaygr_ranker_not_counted", "", registry=registry)
        for _ in range(timeouts):
            fetch.labels("timeout").observe(0.03)
        fetch.labels("hit").observe(0.002)
        drops.labels("hbm", "evicted").inc(3)
        other.inc()
        server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        servers.append((server, thread))
        urls.append(f"http://127.0.0.1:{server.server_port}/metrics")
    yield urls
    for server, thread in servers:
        server.shutdown()
        thread.join()


def test_the_counters_are_summed_over_the_rankers_serving(two_rankers: list[str]) -> None:
    counted = ranker_counters([*two_rankers, None])
    assert counted == {
        "relaygr_ranker_fetch_seconds_count{result=hit}": 2.0,
        "relaygr_ranker_fetch_seconds_count{result=timeout}": 3.0,
        "relaygr_ranker_fetch_seconds_sum{result=hit}": pytest.approx(0.004),
        "relaygr_ranker_fetch_seconds_sum{result=timeout}": pytest.approx(0.09),
        "relaygr_ranker_kv_drops_total{reason=evicted,tier=hbm}": 6.0,
    }


def _arrival(user: str, tokens: int) -> Arrival:
    ints = np.arange(tokens - 1, dtype=np.int64)
    prefix = Prefix(UserId(user), np.zeros(1, np.int64), Behaviours(ints, ints, ints))
    empty = np.zeros(0, np.int64)
    return Arrival(0.0, RankInput(prefix, Behaviours(empty, empty, empty), empty, 0))


def test_a_miss_is_cold_only_on_the_users_first_rank_of_the_run() -> None:
    arrivals = [_arrival("a", 100), _arrival("b", 300), _arrival("a", 100), _arrival("c", 50)]
    records = [
        RequestRecord(2, 12.0, 0.01, OK, "miss", "ranker-1"),  # a again: a prefix lost
        RequestRecord(0, 1.0, 0.01, OK, "hbm_hit", "ranker-0"),  # a first, before the change
        RequestRecord(1, 11.0, 0.01, OK, "miss", "ranker-2"),  # b first: cold
        RequestRecord(3, 40.0, 0.01, OK, "miss", "ranker-0"),  # after the window
    ]
    cost = CostModel(1.0, 0.01, 0.0, 0.0, 0.0)  # prefill: 1 ms + 0.01 ms a token
    missed = missed_ranks(records, arrivals, started=10.0, until=30.0, cost=cost)
    assert missed == [
        Missed(1.0, "ranker-2", 300, 4.0, True),
        Missed(2.0, "ranker-1", 100, 2.0, False),
    ]


def _run(missed: list[Missed], counters: dict[str, float]) -> ChangeRun:
    window = Window(400, 0, len(missed), 0, 0, 0.0, 10.0, 30.0, 20.0, [10.0] * 400)
    return ChangeRun(
        "with", CHANGES[0], 7, window, window, window, 6.0, 400, 0,
        missed=missed, counters=counters,
    )  # fmt: skip


def _saved(run: ChangeRun) -> dict:
    machine = {"date": "2026-12-05 00:00 UTC", "commit": "abc1234", "machine": "test", "threads": 1}
    return {
        "command": "bench",
        "machine": machine,
        "runs": [dataclasses.asdict(run)],
        "settings": dataclasses.asdict(Settings()),
    }


def test_the_misses_and_counters_are_rendered_when_kept() -> None:
    run = _run(
        [Missed(14.6, "ranker-1", 812, 9.5, False), Missed(15.0, "ranker-2", 300, 4.25, True)],
        {
            "relaygr_ranker_fetch_seconds_count{result=timeout}": 4.0,
            "relaygr_ranker_fetch_seconds_sum{result=timeout}": 0.1,
            "relaygr_ranker_handoff_refused_entries_total{reason=no_room}": 2.0,
        },
    )
    text = render(_saved(run))
    row = next(line for line in text.splitlines() if "14.6: ranker-1 812/9.5;" in line)
    assert "15.0: ranker-2 300/4.2 first" in row
    assert "result=timeout 4 (25.0 ms)" in row
    assert "refused reason=no_room 2" in row
    assert "none streams; admitted none" in row


def test_a_run_saved_before_they_were_kept_renders_no_such_table() -> None:
    assert "What the misses were" not in render(_saved(_run([], {})))
