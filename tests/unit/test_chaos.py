"""The chaos books, pure: recovery time, score checks, the report table."""

import numpy as np

from bench.chaos import (
    ChaosSettings,
    FaultReport,
    recovery_s,
    render_table,
    wrong_scores,
)
from tests.unit.ranker.factories import prefix, rank_input
from tooling.local.drive import RequestRecord
from tooling.local.workload import Arrival


def hit(at: float) -> RequestRecord:
    return RequestRecord(0, at, 0.01, "OK", "hbm_hit")


def miss(at: float) -> RequestRecord:
    return RequestRecord(0, at, 0.01, "OK", "miss")


def failed(at: float, status: str = "UNAVAILABLE") -> RequestRecord:
    return RequestRecord(0, at, 0.01, status)


def test_recovery_is_the_first_rank_after_the_last_miss_or_failure() -> None:
    records = [hit(1.0), failed(2.0), miss(3.5), hit(4.0), hit(4.5), hit(5.0)]
    assert recovery_s(records, fault_end_s=3.0, tail=3) == 1.0  # 4.0 - 3.0
    assert recovery_s(list(reversed(records)), fault_end_s=3.0, tail=3) == 1.0  # any order


def test_misses_before_the_fault_ended_cost_no_recovery_time() -> None:
    records = [hit(1.0), miss(2.0), hit(2.5), hit(3.5), hit(4.0)]
    assert recovery_s(records, fault_end_s=3.0, tail=3) == 0.0


def test_no_recovery_unless_enough_hits_follow() -> None:
    records = [hit(1.0), hit(2.0), miss(4.0), hit(4.5), hit(5.0)]
    assert recovery_s(records, fault_end_s=3.0, tail=3) is None
    assert recovery_s([], fault_end_s=3.0, tail=1) is None
    assert recovery_s([hit(1.0)], fault_end_s=3.0, tail=1) == 0.0


def test_wrong_scores_counts_mismatches_versions_and_shapes(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, 10), 2, 3)
    arrivals = [Arrival(0.0, request)] * 5
    expected = np.arange(1.0, 7.0).reshape(2, 3)
    records = [
        RequestRecord(0, 0.0, 0.0, "OK", "hbm_hit", "r0", "v1", expected.astype(np.float32)),
        RequestRecord(1, 0.0, 0.0, "OK", "hbm_hit", "r0", "v1", expected * (1 + 1e-4)),  # off
        RequestRecord(2, 0.0, 0.0, "OK", "hbm_hit", "r0", "v0", expected),  # another model
        RequestRecord(3, 0.0, 0.0, "OK", "hbm_hit", "r0", "v1", expected[:, :2]),  # a score short
        RequestRecord(4, 0.0, 0.0, "UNAVAILABLE"),  # not checked
    ]
    checked, wrong = wrong_scores(records, arrivals, lambda _: expected, "v1", ChaosSettings(), rng)
    assert (checked, wrong) == (4, 3)


def test_the_table_names_each_failure_status_and_an_unrecovered_fault() -> None:
    report = FaultReport(
        fault="etcd stopped", sent=10, succeeded=7, failed={"UNAVAILABLE": 2, "HUNG": 1},
        hung=1, unexpected=0, verified=7, wrong_scores=0, misses=1, fault_start_s=1.0,
        fault_end_s=4.5, recovery_s=None, served_by={"r0": 7}, decisions={},
    )  # fmt: skip
    row = render_table([report]).splitlines()[-1]
    assert row == (
        "| etcd stopped | 10 | 7 | 1 HUNG, 2 UNAVAILABLE | 0 of 7 checked | 1 | 1 | 3.5 "
        "| not within the phase |"
    )
    assert not report.passed
