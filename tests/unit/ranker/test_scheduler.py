"""Compute scheduler: rank work first, background yields per step, bounded queues, deadlines."""

import threading
from collections.abc import Generator
from concurrent.futures import CancelledError

import pytest

from relaygr.errors import DeadlineExceeded, ResourceExhausted
from services.ranker.scheduler import ComputeScheduler, Job, Priority


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


def step_order(scheduler: ComputeScheduler) -> list[str]:
    """The jobs the worker took, step by step, from the scheduler's event log."""
    return [e.job for e in scheduler.events if e.kind == "step" and e.job != "hold"]


def test_background_jobs_run_earliest_due_first_and_ranks_still_first() -> None:
    h = Held()
    dues = {"c": 30.0, "a": 10.0, "undated": None, "b": 20.0, "a2": 10.0}
    jobs = [
        h.scheduler.submit(name, steps(2, [], name), Priority.BACKGROUND, due=due)
        for name, due in dues.items()
    ]
    h.scheduler.submit("rank", steps(1, [], "r"), Priority.RANK)
    h.release()
    for job in jobs:
        job.future.result(10)
    # Each job: two steps and the one that returns. Ties of due in submission order.
    assert step_order(h.scheduler) == ["rank"] * 2 + [
        name for name in ("a", "a2", "b", "c", "undated") for _ in range(3)
    ]
    h.scheduler.stop()


def test_a_job_due_sooner_overtakes_a_running_one_between_chunks() -> None:
    scheduler = ComputeScheduler({Priority.RANK: 8, Priority.BACKGROUND: 8})
    log: list[str] = []

    def late() -> Generator[None, None, str]:
        for i in range(3):
            log.append(f"late{i}")
            if i == 0:  # arrives while late's first chunk runs
                scheduler.submit("soon", steps(2, log, "soon"), Priority.BACKGROUND, due=5.0)
                scheduler.submit("tied", steps(1, log, "tied"), Priority.BACKGROUND, due=100.0)
            yield
        return "late"

    scheduler.start()
    job = scheduler.submit("late", late(), Priority.BACKGROUND, due=100.0)
    assert job.future.result(10) == "late"
    scheduler.stop()
    # Preempted by the sooner job between chunks; resumed before the younger job of its due.
    assert log == ["late0", "soon0", "soon1", "late1", "late2", "tied0"]


def test_queued_background_ms_follows_submissions_steps_and_promotions() -> None:
    seen: list[float] = []

    def recording(job: Job) -> None:
        seen.append(scheduler.queued_background_ms())  # before each step
        next(job.steps)

    scheduler = ComputeScheduler({Priority.RANK: 8, Priority.BACKGROUND: 8}, executor=recording)
    gate, entered = threading.Event(), threading.Event()
    scheduler.submit("hold", held(gate, entered), Priority.RANK)
    scheduler.start()
    assert entered.wait(10)
    assert scheduler.queued_background_ms() == 0.0
    a = scheduler.submit("a", steps(3, [], "a"), Priority.BACKGROUND, due=1.0, step_ms=(1, 2, 3))
    assert scheduler.queued_background_ms() == 6.0
    scheduler.submit("b", steps(1, [], "b"), Priority.BACKGROUND, due=2.0, step_ms=(4,))
    scheduler.submit("r", steps(1, [], "r"), Priority.RANK, step_ms=(50,))  # rank work: not counted
    c = scheduler.submit("c", steps(1, [], "c"), Priority.BACKGROUND, due=3.0, step_ms=(0.25,))
    assert scheduler.queued_background_ms() == 10.25
    scheduler.promote(c)  # rank work now
    assert scheduler.queued_background_ms() == 10.0
    assert (scheduler.depth(Priority.BACKGROUND), scheduler.depth(Priority.RANK)) == (2, 2)
    gate.set()
    a.future.result(10)
    scheduler.stop()
    # Each job's steps, then the call that returns: r, c (rank first), then a, then b.
    assert seen[1:] == [*(10.0, 10.0), *(10.0, 10.0), *(10.0, 9.0, 7.0, 4.0), *(4.0, 0.0)]
    assert scheduler.queued_background_ms() == 0.0


def test_restart_replaces_a_queued_jobs_steps_at_rank_priority() -> None:
    h = Held()
    log: list[str] = []
    old = h.scheduler.submit("p", steps(3, log, "old"), Priority.BACKGROUND, step_ms=(5, 5, 5))
    other = h.scheduler.submit("q", steps(1, log, "q"), Priority.BACKGROUND, due=1.0)
    assert h.scheduler.restart(old, steps(1, log, "new"), (7,), deadline=None)
    assert old.priority is Priority.RANK and old.remaining_ms == 7
    assert h.scheduler.queued_background_ms() == 0.0  # only background work counts
    h.release()
    assert old.future.result(10) == "new"
    other.future.result(10)
    assert log == ["new0", "q0"]  # ahead of the background job due sooner
    assert not h.scheduler.restart(old, steps(1, log, "again"), ())  # finished: nothing changes
    h.scheduler.stop()


def test_events_carry_the_injected_clock() -> None:
    h = Held()
    h.now = 42.0
    job = h.scheduler.submit("x", steps(1, [], "x"), Priority.BACKGROUND)
    h.release()
    job.future.result(10)
    h.scheduler.stop()
    assert [(e.kind, e.at) for e in h.scheduler.events if e.job == "x"] == [
        ("submitted", 42.0),
        ("step", 42.0),
        ("step", 42.0),
        ("done", 42.0),
    ]


def test_queued_rank_ms_follows_submissions_steps_promotions_and_restarts() -> None:
    seen: list[float] = []

    def recording(job: Job) -> None:
        seen.append(scheduler.queued_rank_ms())  # before each step
        next(job.steps)

    scheduler = ComputeScheduler({Priority.RANK: 8, Priority.BACKGROUND: 8}, executor=recording)
    gate, entered = threading.Event(), threading.Event()
    scheduler.submit("hold", held(gate, entered), Priority.RANK)
    scheduler.start()
    assert entered.wait(10)
    assert scheduler.queued_rank_ms() == 0.0
    r = scheduler.submit("r", steps(2, [], "r"), Priority.RANK, step_ms=(3, 5))
    assert scheduler.queued_rank_ms() == 8.0
    b = scheduler.submit("b", steps(1, [], "b"), Priority.BACKGROUND, due=1.0, step_ms=(4,))
    assert scheduler.queued_rank_ms() == 8.0  # background work: not counted
    scheduler.promote(b)  # rank work now
    assert (scheduler.queued_rank_ms(), scheduler.queued_background_ms()) == (12.0, 0.0)
    p = scheduler.submit("p", steps(3, [], "p"), Priority.BACKGROUND, due=2.0, step_ms=(2, 2, 2))
    assert scheduler.restart(p, steps(1, [], "p2"), (1.5,))  # rank work, with its new steps
    assert (scheduler.queued_rank_ms(), scheduler.queued_background_ms()) == (13.5, 0.0)
    gate.set()
    r.future.result(10)
    p.future.result(10)
    scheduler.stop()
    # Each rank job's steps and the call that returns, in arrival order: r (3, 5), b (4), p (1.5).
    assert seen[1:] == [*(13.5, 10.5, 5.5), *(5.5, 1.5), *(1.5, 0.0)]
    assert scheduler.queued_rank_ms() == 0.0
