"""Ranking-first compute queues, driven directly (no worker, no thread): rank work first,
background yields per step, bounded queues, deadlines, earliest-due background, promotion,
restart, the queued-time totals and the event log's injected clock."""

import pytest

from services.ranker.queues import ComputeQueues, Job, Overloaded, Priority


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(rank: int = 8, background: int = 8) -> tuple[ComputeQueues, Clock]:
    clock = Clock()
    limits = {Priority.RANK: rank, Priority.BACKGROUND: background}
    return ComputeQueues(limits, clock), clock


def step(queues: ComputeQueues, steps: dict[str, int]) -> Job | None:
    """What a worker does once: take the next job and run one step of it; `steps` says how
    many steps each job has (the one that reaches it ends the job)."""
    job, _ = queues.take()
    if job is None:
        return None
    ms = job.next_step_ms
    if job.steps_run + 1 == steps[job.name]:
        job.steps_run += 1
        queues.end(job, "done")
    else:
        queues.stepped(job, ms)
    return job


def run(queues: ComputeQueues, steps: dict[str, int]) -> list[str]:
    """Step until every queue is empty: the job of each step, in order."""
    order = []
    while (job := step(queues, steps)) is not None:
        order.append(job.name)
    return order


def test_rank_jobs_overtake_queued_background_steps() -> None:
    queues, _ = make()
    queues.submit("bg", None, Priority.BACKGROUND)
    queues.submit("rank", None, Priority.RANK)
    assert run(queues, {"bg": 3, "rank": 1}) == ["rank", "bg", "bg", "bg"]


def test_a_rank_submitted_mid_job_runs_after_the_current_step() -> None:
    queues, _ = make()
    queues.submit("bg", None, Priority.BACKGROUND)
    steps = {"bg": 4, "rank": 1}
    for _ in range(2):
        assert step(queues, steps) is not None  # the background job's first two steps
    queues.submit("rank", None, Priority.RANK)  # arrives while its second step runs
    assert run(queues, steps) == ["rank", "bg", "bg"]


def test_promotion_lifts_background_work_above_later_ranks() -> None:
    queues, _ = make()
    background = queues.submit("bg", None, Priority.BACKGROUND)
    queues.promote(background)
    queues.submit("rank", None, Priority.RANK)
    assert background.priority is Priority.RANK
    assert run(queues, {"bg": 2, "rank": 1}) == ["bg", "bg", "rank"]
    assert [e.kind for e in queues.events if e.job == "bg"][:2] == ["submitted", "promoted"]


def test_queues_are_bounded_per_priority() -> None:
    queues, _ = make(rank=1, background=2)
    queues.submit("r", None, Priority.RANK)
    with pytest.raises(Overloaded, match="overloaded: 1 rank jobs queued"):
        queues.submit("r2", None, Priority.RANK)
    for _ in range(2):
        queues.submit("b", None, Priority.BACKGROUND)
    with pytest.raises(Overloaded, match="2 background jobs queued"):
        queues.submit("b3", None, Priority.BACKGROUND)
    assert [e.kind for e in queues.events].count("shed") == 2
    assert (queues.depth(Priority.RANK), queues.depth(Priority.BACKGROUND)) == (1, 2)
    queues.take()  # a taken job no longer counts against its queue's bound
    queues.submit("r3", None, Priority.RANK)


def test_expired_and_cancelled_jobs_never_run() -> None:
    queues, clock = make()
    queues.submit("late", None, Priority.RANK, deadline=5.0)
    gone = queues.submit("gone", None, Priority.RANK)
    queues.submit("kept", None, Priority.RANK, deadline=50.0)
    clock.now = 10.0
    job, dropped = queues.take(lambda j: j is not gone)  # the driver's check: its caller left
    assert job is not None and job.name == "kept" and job.started
    assert [(j.name, j.cancelled) for j in dropped] == [("late", False), ("gone", True)]
    kinds = {e.job: e.kind for e in queues.events if e.kind in ("expired", "cancelled")}
    assert kinds == {"late": "expired", "gone": "cancelled"}
    assert not queues.restart(gone, None, ())  # a cancelled job is never run again


def test_a_started_job_is_stepped_past_its_deadline() -> None:
    """The deadline is checked before the first step only: a started job finishes."""
    queues, clock = make()
    queues.submit("r", None, Priority.RANK, deadline=5.0)
    assert step(queues, {"r": 2}) is not None
    clock.now = 10.0
    assert run(queues, {"r": 2}) == ["r"]
    assert "expired" not in [e.kind for e in queues.events]


def test_a_failed_job_leaves_the_books_and_the_others_run() -> None:
    queues, _ = make()
    queues.submit("bad", None, Priority.BACKGROUND, step_ms=(2, 2))
    queues.submit("good", None, Priority.BACKGROUND, step_ms=(3,))
    bad, _ = queues.take()
    assert bad is not None and bad.name == "bad"
    queues.end(bad, "failed")  # its step raised: the driver ends it
    assert queues.queued_background_ms() == 3.0
    assert run(queues, {"good": 1}) == ["good"]
    assert queues.queued_background_ms() == 0.0
    assert [e.kind for e in queues.events if e.job == "bad"] == ["submitted", "step", "failed"]


def test_background_jobs_run_earliest_due_first_and_ranks_still_first() -> None:
    queues, _ = make()
    dues = {"c": 30.0, "a": 10.0, "undated": None, "b": 20.0, "a2": 10.0}
    for name, due in dues.items():
        queues.submit(name, None, Priority.BACKGROUND, due=due)
    queues.submit("rank", None, Priority.RANK)
    # Ties of due in submission order; undated after every dated job.
    assert run(queues, {**dict.fromkeys(dues, 2), "rank": 1}) == ["rank"] + [
        name for name in ("a", "a2", "b", "c", "undated") for _ in range(2)
    ]


def test_a_job_due_sooner_overtakes_a_running_one_between_chunks() -> None:
    queues, _ = make()
    queues.submit("late", None, Priority.BACKGROUND, due=100.0)
    steps = {"late": 3, "soon": 2, "tied": 1}
    assert step(queues, steps) is not None  # late's first chunk runs; meanwhile two more arrive
    queues.submit("soon", None, Priority.BACKGROUND, due=5.0)
    queues.submit("tied", None, Priority.BACKGROUND, due=100.0)
    # Preempted by the sooner job between chunks; resumed before the younger job of its due.
    assert run(queues, steps) == ["soon", "soon", "late", "late", "tied"]


def test_queued_background_ms_follows_submissions_steps_and_promotions() -> None:
    queues, _ = make()
    assert queues.queued_background_ms() == 0.0
    queues.submit("a", None, Priority.BACKGROUND, due=1.0, step_ms=(1, 2, 3))
    assert queues.queued_background_ms() == 6.0
    queues.submit("b", None, Priority.BACKGROUND, due=2.0, step_ms=(4,))
    queues.submit("r", None, Priority.RANK, step_ms=(50,))  # rank work: not counted
    c = queues.submit("c", None, Priority.BACKGROUND, due=3.0, step_ms=(0.25,))
    assert queues.queued_background_ms() == 10.25
    queues.promote(c)  # rank work now
    assert queues.queued_background_ms() == 10.0
    assert (queues.depth(Priority.BACKGROUND), queues.depth(Priority.RANK)) == (2, 2)
    seen = []
    steps = {"a": 3, "b": 1, "r": 1, "c": 1}
    while True:
        seen.append(queues.queued_background_ms())  # before each step
        if step(queues, steps) is None:
            break
    # r, c (rank first), then a's three steps, then b; the total exactly 0 at the end.
    assert seen == [10.0, 10.0, 10.0, 9.0, 7.0, 4.0, 0.0]


def test_restart_replaces_a_queued_jobs_steps_at_rank_priority() -> None:
    queues, _ = make()
    old = queues.submit("p", "old", Priority.BACKGROUND, step_ms=(5, 5, 5))
    queues.submit("q", "q", Priority.BACKGROUND, due=1.0)
    old.partial = "half"
    assert queues.restart(old, "new", (7,), deadline=None)
    assert (old.spec, old.partial, old.steps_run) == ("new", None, 0)
    assert old.priority is Priority.RANK and old.remaining_ms == 7
    assert queues.queued_background_ms() == 0.0  # only background work counts
    assert queues.queued_rank_ms() == 7.0
    assert run(queues, {"p": 1, "q": 1}) == ["p", "q"]  # ahead of the background job due sooner
    assert not queues.restart(old, "again", ())  # finished: nothing changes
    assert old.spec == "new"


def test_events_carry_the_injected_clock() -> None:
    queues, clock = make()
    clock.now = 42.0
    queues.submit("x", None, Priority.BACKGROUND)
    run(queues, {"x": 2})
    assert [(e.kind, e.at) for e in queues.events if e.job == "x"] == [
        ("submitted", 42.0),
        ("step", 42.0),
        ("step", 42.0),
        ("done", 42.0),
    ]


def test_queued_rank_ms_follows_submissions_steps_promotions_and_restarts() -> None:
    queues, _ = make()
    assert queues.queued_rank_ms() == 0.0
    queues.submit("r", None, Priority.RANK, step_ms=(3, 5))
    assert queues.queued_rank_ms() == 8.0
    b = queues.submit("b", None, Priority.BACKGROUND, due=1.0, step_ms=(4,))
    assert queues.queued_rank_ms() == 8.0  # background work: not counted
    queues.promote(b)  # rank work now
    assert (queues.queued_rank_ms(), queues.queued_background_ms()) == (12.0, 0.0)
    p = queues.submit("p", None, Priority.BACKGROUND, due=2.0, step_ms=(2, 2, 2))
    assert queues.restart(p, None, (1.5,))  # rank work, with its new steps
    assert (queues.queued_rank_ms(), queues.queued_background_ms()) == (13.5, 0.0)
    seen = []
    steps = {"r": 2, "b": 1, "p": 1}
    while True:
        seen.append(queues.queued_rank_ms())  # before each step
        if step(queues, steps) is None:
            break
    # In arrival order: r (3, 5), b (4), p (1.5); exactly 0 at the end.
    assert seen == [13.5, 10.5, 5.5, 1.5, 0.0]
