"""Compute scheduler: rank work first, background yields per step, bounded queues, deadlines."""

import threading
from collections.abc import Generator
from concurrent.futures import CancelledError

import pytest

from relaygr.errors import DeadlineExceeded, ResourceExhausted
from services.ranker.scheduler import ComputeScheduler, Priority


def steps(n: int, log: list[str], name: str) -> Generator[None, None, str]:
    for i in range(n):
        log.append(f"{name}{i}")
        yield
    return name


def held(gate: threading.Event, entered: threading.Event) -> Generator[None, None, None]:
    entered.set()
    gate.wait(10)
    return None
    yield


class Held:
    """A scheduler whose worker is parked on a job until `release()`."""

    def __init__(self, **queues: int) -> None:
        limits = {Priority.RANK: queues.get("rank", 8), Priority.BACKGROUND: queues.get("bg", 8)}
        self.now = 0.0
        self.scheduler = ComputeScheduler(limits, clock=lambda: self.now)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.scheduler.start()
        self.scheduler.submit("hold", held(self.gate, self.entered), Priority.RANK)
        assert self.entered.wait(10)

    def release(self) -> None:
        self.gate.set()


def test_rank_jobs_overtake_queued_background_steps() -> None:
    h = Held()
    log: list[str] = []
    background = h.scheduler.submit("bg", steps(3, log, "b"), Priority.BACKGROUND)
    rank = h.scheduler.submit("rank", steps(1, log, "r"), Priority.RANK)
    h.release()
    assert rank.future.result(10) == "r" and background.future.result(10) == "b"
    assert log == ["r0", "b0", "b1", "b2"]
    h.scheduler.stop()


def test_a_rank_submitted_mid_job_runs_after_the_current_step() -> None:
    scheduler = ComputeScheduler({Priority.RANK: 8, Priority.BACKGROUND: 8})
    log: list[str] = []
    step_started, resume = threading.Event(), threading.Event()

    def background() -> Generator[None, None, str]:
        for i in range(4):
            log.append(f"b{i}")
            if i == 1:
                step_started.set()
                resume.wait(10)
            yield
        return "b"

    scheduler.start()
    job = scheduler.submit("bg", background(), Priority.BACKGROUND)
    assert step_started.wait(10)
    rank = scheduler.submit("rank", steps(1, log, "r"), Priority.RANK)
    resume.set()
    rank.future.result(10)
    job.future.result(10)
    assert log == ["b0", "b1", "r0", "b2", "b3"]
    scheduler.stop()


def test_promotion_lifts_background_work_above_later_ranks() -> None:
    h = Held()
    log: list[str] = []
    background = h.scheduler.submit("bg", steps(2, log, "b"), Priority.BACKGROUND)
    h.scheduler.promote(background)
    rank = h.scheduler.submit("rank", steps(1, log, "r"), Priority.RANK)
    h.release()
    background.future.result(10)
    rank.future.result(10)
    assert log == ["b0", "b1", "r0"]
    h.scheduler.stop()


def test_queues_are_bounded_per_priority() -> None:
    h = Held(rank=1, bg=2)
    h.scheduler.submit("r", steps(1, [], "r"), Priority.RANK)
    with pytest.raises(ResourceExhausted, match="overloaded: 1 rank jobs queued"):
        h.scheduler.submit("r2", steps(1, [], "r"), Priority.RANK)
    for _ in range(2):
        h.scheduler.submit("b", steps(1, [], "b"), Priority.BACKGROUND)
    with pytest.raises(ResourceExhausted, match="2 background jobs queued"):
        h.scheduler.submit("b3", steps(1, [], "b"), Priority.BACKGROUND)
    assert [e.kind for e in h.scheduler.events].count("shed") == 2
    h.release()
    h.scheduler.stop()


def test_expired_and_cancelled_jobs_never_run() -> None:
    h = Held()
    log: list[str] = []
    late = h.scheduler.submit("late", steps(1, log, "late"), Priority.RANK, deadline=5.0)
    gone = h.scheduler.submit("gone", steps(1, log, "gone"), Priority.RANK)
    kept = h.scheduler.submit("kept", steps(1, log, "kept"), Priority.RANK, deadline=50.0)
    assert gone.future.cancel()
    h.now = 10.0
    h.release()
    assert kept.future.result(10) == "kept"
    with pytest.raises(DeadlineExceeded, match="late: deadline passed while queued"):
        late.future.result(10)
    with pytest.raises(CancelledError):
        gone.future.result(10)
    assert log == ["kept0"]
    kinds = {e.job: e.kind for e in h.scheduler.events if e.kind in ("expired", "cancelled")}
    assert kinds == {"late": "expired", "gone": "cancelled"}
    h.scheduler.stop()


def test_a_failing_step_fails_only_its_job() -> None:
    h = Held()

    def broken() -> Generator[None, None, None]:
        yield
        raise ValueError("boom")

    bad = h.scheduler.submit("bad", broken(), Priority.BACKGROUND)
    good = h.scheduler.submit("good", steps(1, [], "g"), Priority.BACKGROUND)
    h.release()
    with pytest.raises(ValueError, match="boom"):
        bad.future.result(10)
    assert good.future.result(10) == "g"
    h.scheduler.stop()


def test_stop_finishes_queued_work_then_refuses() -> None:
    h = Held()
    job = h.scheduler.submit("last", steps(2, [], "x"), Priority.BACKGROUND)
    h.release()
    h.scheduler.stop()
    assert job.future.result(0) == "x"
    with pytest.raises(ResourceExhausted, match="shutting down"):
        h.scheduler.submit("after", steps(1, [], "y"), Priority.RANK)
