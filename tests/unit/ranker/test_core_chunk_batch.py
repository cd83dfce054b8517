"""RankerCore batches background prefill chunks: several users' chunk steps queued together when
the worker frees run as one call, within the max-batch bounds, in the background queue's order,
only when sharing pays or a backlog is queued, never with rank work; a Rank still goes first at
the next free worker; a failed call's chunks run again alone. Pure: no model, no thread."""

from dataclasses import replace

from relaygr.cost import CallShape
from services.ranker.core import RankerCore
from services.ranker.core_types import (
    Computed,
    FullForward,
    JobEnded,
    Observation,
    Prefill,
    PreInferAnswer,
    RequestId,
    Score,
    call_shape,
)
from services.ranker.kv_store import Tier
from services.ranker.outcomes import PreInferOutcome, Work
from services.ranker.queues import Job, Priority
from tests.unit.ranker.test_core import (
    COST,
    KV,
    USER_FEATURES,
    Driver,
    R,
    held,
    make,
    prefix,
    product,
)
from tests.unit.ranker.test_core_batch import BATCHING, batched, calls, hit, resident, users

# SETTINGS' 64-token chunks over a prefix of 4 user features and 100 behaviours: two steps.
FIRST = CallShape(0, 64, 0)
SECOND = CallShape(64, USER_FEATURES + 100 - 64, 0)


def pre_infer(d: Driver, *names: str) -> dict[str, RequestId]:
    """A PreInfer of each user's prefix (nothing runs yet): its request ids."""
    return {u: d.pre_infer(prefix(u, start=1000 * ord(u))) for u in names}


def next_call(core: RankerCore[KV], d: Driver) -> tuple[Job, ...]:
    """The worker frees: the call it takes (the running one is done)."""
    [call] = calls(core.worker_free())
    d.running = list(call)
    return call


def done(core: RankerCore[KV], d: Driver, call: tuple[Job, ...]) -> None:
    """Every step of `call` ends with its product."""
    d.running = []
    for job in call:
        d.feed(core.step_done(job, product(job)))


def chunks(call: tuple[Job, ...]) -> list[tuple[str, int]]:
    """(user, step) of each chunk of `call`."""
    assert all(isinstance(j.spec, Prefill) and j.priority is Priority.BACKGROUND for j in call)
    return [(job.spec.prefix.user, job.steps_run) for job in call]


def test_several_users_background_chunks_run_as_one_call_bounded_by_max_requests() -> None:
    seen: list[Observation] = []
    core, d, _ = make(hbm_prefixes=12, settings=batched(max_batch_requests=3), observe=seen.append)
    rids = pre_infer(d, *"abcde")
    first = next_call(core, d)
    assert chunks(first) == [("a", 0), ("b", 0), ("c", 0)]  # the background order, three at most
    assert [call_shape(j.spec, held, j.steps_run) for j in first] == [FIRST] * 3
    done(core, d, first)
    # Each job's later chunk goes back to the background order (a, b, c were due first).
    second = next_call(core, d)
    assert chunks(second) == [("a", 1), ("b", 1), ("c", 1)]
    assert [call_shape(j.spec, held, j.steps_run) for j in second] == [SECOND] * 3
    done(core, d, second)
    assert chunks(next_call(core, d)) == [("d", 0), ("e", 0)]
    d.run()
    assert core.queued() == 0
    for user, rid in rids.items():
        answer = d.result(rid)
        assert isinstance(answer, PreInferAnswer) and answer.outcome is PreInferOutcome.COMPUTED
        assert core.store.get(answer.key, Tier.HBM) is not None, user
    # The batch statistics count scoring calls only; a prefix job that shared a call reports
    # no time of its own (its steps' time holds other users' chunks), its landing still.
    stats = core.stats()
    assert stats.batch_requests.count == 0
    # Per chunk call: a, b, c's first chunks, their second, d and e's first, their second.
    assert stats.chunk_batch_requests.count == 4
    assert stats.chunk_batch_requests.total == 5 * 2  # five users, two chunks each
    assert stats.chunk_batch_rows.total == 5 * (USER_FEATURES + 100)  # every prefix token once
    assert not [o for o in seen if isinstance(o, Computed)]
    landed = [o for o in seen if isinstance(o, JobEnded) and o.work is Work.PREFILL]
    assert sorted(o.job.spec.prefix.user for o in landed) == list("abcde")


def test_a_chunk_call_stops_at_max_rows_and_the_chunk_that_does_not_fit_keeps_its_place() -> None:
    core, d, _ = make(hbm_prefixes=12, settings=batched(max_batch_rows=2 * 64))
    pre_infer(d, *"abc")
    first = next_call(core, d)
    assert chunks(first) == [("a", 0), ("b", 0)]  # c's 64 rows would make 192
    done(core, d, first)
    second = next_call(core, d)
    # a's and b's second chunks (40 rows each) are due before c's first: c is not taken past.
    assert chunks(second) == [("a", 1), ("b", 1)]
    done(core, d, second)
    assert chunks(next_call(core, d)) == [("c", 0)]


def test_background_chunks_never_share_a_call_with_rank_work_and_a_rank_goes_first() -> None:
    """While a chunk call runs, a cached Rank (x) and a miss (m) arrive: at the next free worker
    x's Score runs first, alone (the chunks queued are never put in its call), then m's one
    call (its full inference, keeping the prefix), and only then the users' next chunks, again
    as one call."""
    core, d, clock = make(hbm_prefixes=12, settings=BATCHING)
    resident(d, "x")
    pre_infer(d, *"abc")
    first = next_call(core, d)
    assert chunks(first) == [("a", 0), ("b", 0), ("c", 0)]
    d.rank(hit("x"))
    clock.now += 1.0
    d.rank(R(prefix("m")))
    done(core, d, first)
    score = next_call(core, d)
    assert users(score) == ["x"] and isinstance(score[0].spec, Score)
    done(core, d, score)
    [own] = next_call(core, d)
    assert isinstance(own.spec, FullForward) and own.priority is Priority.RANK
    done(core, d, (own,))
    assert chunks(next_call(core, d)) == [("a", 1), ("b", 1), ("c", 1)]


def test_a_prefix_job_promoted_for_a_waiting_rank_leaves_the_chunk_calls() -> None:
    """A Rank that waits for b's background prefill promotes it to rank priority: b's next
    chunk runs alone, ahead of the others, which go on as one call without it."""
    core, d, _ = make(hbm_prefixes=12, settings=BATCHING, cost=replace(COST, fixed_ms=0.0))
    pre_infer(d, *"abc")
    first = next_call(core, d)
    assert chunks(first) == [("a", 0), ("b", 0), ("c", 0)]
    d.rank(hit("b"))  # no fixed cost per chunk: restarting it is not sooner, so it waits
    done(core, d, first)
    [b] = next_call(core, d)
    assert (b.spec.prefix.user, b.steps_run, b.priority) == ("b", 1, Priority.RANK)
    done(core, d, (b,))
    [score] = next_call(core, d)
    assert isinstance(score.spec, Score)
    done(core, d, (score,))
    assert chunks(next_call(core, d)) == [("a", 1), ("c", 1)]


def test_chunks_that_save_little_batch_only_behind_a_backlog() -> None:
    """This cost model saves nothing by sharing a call: three queued PreInfers' chunks run one
    by one, as unbatched; from `batch_backlog` (4) queued background jobs, the head included,
    they share one."""
    assert COST.batch_saving_ms == 0
    core, d, _ = make(hbm_prefixes=12)  # the default settings: batch_backlog 4
    assert core.settings.batch_backlog == 4
    pre_infer(d, *"abc")
    assert chunks(next_call(core, d)) == [("a", 0)]
    core, d, _ = make(hbm_prefixes=12)
    pre_infer(d, *"abcd")
    assert chunks(next_call(core, d)) == [("a", 0), ("b", 0), ("c", 0), ("d", 0)]


def test_chunks_that_save_half_their_call_batch_at_any_load() -> None:
    single = COST.shape_ms(FIRST)
    for saving, together in ((single / 2, True), (single / 2 - 1e-6, False)):
        core, d, _ = make(hbm_prefixes=12, cost=replace(COST, batch_saving_ms=saving))
        pre_infer(d, *"ab")
        first = chunks(next_call(core, d))
        assert first == ([("a", 0), ("b", 0)] if together else [("a", 0)]), saving


def test_a_failed_chunk_call_runs_its_chunks_again_alone() -> None:
    """The call fails: its jobs go back to the background order, their steps not run, and run
    alone from then on; one that fails alone fails its own PreInfer only."""
    core, d, _ = make(hbm_prefixes=12, settings=BATCHING)
    rids = pre_infer(d, *"abc")
    first = next_call(core, d)
    assert chunks(first) == [("a", 0), ("b", 0), ("c", 0)]
    d.running = []
    assert core.batch_failed(first, RuntimeError("device out of memory")) == []
    assert core.queued() == 3
    ran = []
    while core.queued():
        [job] = next_call(core, d)
        ran.append((job.spec.prefix.user, job.steps_run))
        d.running = []
        if job.spec.prefix.user == "b":
            d.feed(core.step_failed(job, ValueError("bad input")))
        else:
            d.feed(core.step_done(job, product(job)))
    assert ran == [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1)]
    errors = [type(d.answers[rid].error) for rid in rids.values()]
    assert errors == [type(None), ValueError, type(None)]


def test_a_chunk_joins_whatever_its_pre_infers_deadline() -> None:
    """A chunk answers no one when its call ends (a PreInfer is answered when its prefix
    lands), and a job's deadline bounds only its start: chunks whose PreInfers' deadlines the
    call outlasts, or that passed since their first chunk, still share one call."""
    core, d, clock = make(hbm_prefixes=12, settings=BATCHING)
    deadline = clock.now + COST.shape_ms(FIRST) / 1e3 / 2  # before one chunk alone would end
    for u in "ab":
        _, actions = core.pre_infer(prefix(u, start=1000 * ord(u)), None, deadline)
        d.feed(actions)
    first = next_call(core, d)
    assert chunks(first) == [("a", 0), ("b", 0)]
    done(core, d, first)
    clock.now = deadline + 1.0
    assert chunks(next_call(core, d)) == [("a", 1), ("b", 1)]


def test_a_chunk_call_holds_at_most_max_chunk_batch_rows_so_a_rank_waits_about_one_chunk() -> None:
    """A Rank arriving while a chunk call runs waits for all of it, so chunk calls have their
    own row bound (`max_chunk_batch_rows`; here one 64-token chunk): full first chunks run one
    by one, while the whole prefixes of short histories (24 tokens) share a call, two to a
    chunk's worth."""
    core, d, _ = make(hbm_prefixes=12, settings=batched(max_chunk_batch_rows=64))
    pre_infer(d, "a", "b")
    assert chunks(next_call(core, d)) == [("a", 0)]  # b's first chunk would make 128 rows
    core, d, _ = make(hbm_prefixes=12, settings=batched(max_chunk_batch_rows=64))
    for u in "abc":
        d.pre_infer(prefix(u, n=20, start=1000 * ord(u)))
    first = next_call(core, d)
    assert chunks(first) == [("a", 0), ("b", 0)]  # c's 24 rows would make 72
    done(core, d, first)
    assert chunks(next_call(core, d)) == [("c", 0)]
