"""RankerCore batches scoring steps: the Ranks queued together when the worker frees run as one
call, within the max-batch bounds, in rank order, never with background work, never with a Rank
that may no longer start; a failed call's Ranks run again alone. Pure: no model, no thread."""

from dataclasses import replace

from relaygr.cost import CallShape, batch_ms
from relaygr.errors import DeadlineExceeded
from services.ranker.core import RankerCore
from services.ranker.core_types import (
    Action,
    Answer,
    BatchComputed,
    Computed,
    CoreSettings,
    FullForward,
    JobEnded,
    Kept,
    Observation,
    Prefill,
    RankAnswer,
    RunBatch,
    RunStep,
    Score,
    ScoringCall,
)
from services.ranker.kv_store import Tier
from services.ranker.outcomes import CacheOutcome, Work
from services.ranker.queues import Job, Priority
from tests.unit.ranker.test_core import (
    COST,
    KV,
    SETTINGS,
    USER_FEATURES,
    Driver,
    R,
    make,
    prefix,
    product,
)
from tests.unit.ranker.test_core import size as sized

ROWS = 8 + 16  # one R's short-term behaviours + candidates
CACHED = USER_FEATURES + 100  # a resident prefix: user features + 100 long-term behaviours


# Any queued step may join (no backlog needed), chunk calls bounded by max_batch_rows alone:
# the tests of the other rules.
BATCHING = replace(SETTINGS, batch_backlog=1, max_chunk_batch_rows=4096)


def batched(settings: CoreSettings = BATCHING, **bounds: int) -> CoreSettings:
    return replace(settings, **bounds)


def resident(d: Driver, *users: str) -> None:
    """Each user's prefix pre-inferred and resident (its relay pinned)."""
    for user in users:
        d.pre_infer(prefix(user, start=1000 * ord(user)))
    d.run()


def hit(user: str) -> R:
    return R(prefix(user, start=1000 * ord(user)))


def holding(core: RankerCore[KV], d: Driver, user: str) -> Job:
    """A background prefill of `user` taken by the worker (its first chunk runs): what arrives
    meanwhile queues."""
    d.pre_infer(prefix(user, start=1000 * ord(user)))
    d.feed(core.worker_free())
    [job] = d.running
    assert isinstance(job.spec, Prefill) and job.priority is Priority.BACKGROUND
    return job


def release(core: RankerCore[KV], d: Driver, job: Job) -> list[Action]:
    """`job`'s step ends; the worker's next call (its actions)."""
    d.running = []
    d.feed(core.step_done(job, product(job)))
    actions = core.worker_free()
    d.feed(actions)
    return actions


def calls(actions: list[Action]) -> list[tuple[Job, ...]]:
    out: list[tuple[Job, ...]] = []
    for action in actions:
        if isinstance(action, RunStep):
            out.append((action.job,))
        elif isinstance(action, RunBatch):
            out.append(action.jobs)
    return out


def users(jobs: tuple[Job, ...] | list[Job]) -> list[str]:
    return [job.spec.request.prefix.user for job in jobs]


def finish(core: RankerCore[KV], d: Driver, jobs: list[Job]) -> None:
    d.running = []
    for job in jobs:
        spec = job.spec
        scores = f"scores of {spec.request.prefix.user}"
        keeps = isinstance(spec, FullForward) and spec.keep
        d.feed(core.step_done(job, Kept(scores, sized(spec.request.prefix)) if keeps else scores))


def test_ranks_queued_behind_a_running_step_run_as_one_call_bounded_by_max_requests() -> None:
    core, d, _ = make(hbm_prefixes=12, settings=batched(max_batch_requests=3))
    resident(d, "a", "b", "c", "d", "e")
    chunk = holding(core, d, "g")
    rids = {u: d.rank(hit(u)) for u in "abcde"}
    assert core.queued() == 1 + 5 + 0  # the running chunk, five Ranks (g waits in neither)
    [first] = calls(release(core, d, chunk))
    assert users(first) == ["a", "b", "c"]  # the head of the rank queue, then in order
    assert all(isinstance(j.spec, Score) and j.priority is Priority.RANK for j in first)
    assert core.queued() == 3 + 2 + 1  # a call's jobs count as running until reported
    finish(core, d, list(first))
    [second] = calls(_next(core, d))
    # The room left is never filled with background work: g's prefill waits for the Ranks.
    assert users(second) == ["d", "e"]
    finish(core, d, list(second))
    for user, rid in rids.items():
        answer = d.result(rid)
        assert isinstance(answer, RankAnswer)
        assert (answer.scores, answer.outcome) == (f"scores of {user}", CacheOutcome.HBM_HIT)
    assert [type(j.spec) for j in d.run()] == [Prefill]  # then g's next chunk
    stats = core.stats()
    assert stats.batch_requests.counts[:3] == (0, 1, 1)  # calls of <=1, 2, 3 Ranks
    assert stats.batch_rows.total == 5 * ROWS


def _next(core: RankerCore[KV], d: Driver) -> list[Action]:
    actions = core.worker_free()
    d.feed(actions)
    return actions


def test_a_batch_stops_at_max_rows_and_the_rank_that_does_not_fit_keeps_its_place() -> None:
    core, d, _ = make(hbm_prefixes=12, settings=batched(max_batch_rows=2 * ROWS + 4))
    resident(d, "a", "b", "c", "e")
    chunk = holding(core, d, "g")
    for u in "abc":
        d.rank(hit(u))
    d.rank(R(prefix("e", start=1000 * ord("e")), short_term=2, candidates=2))  # 4 rows: fits
    [first] = calls(release(core, d, chunk))
    assert users(first) == ["a", "b"]  # c does not fit, and e is not taken past it
    finish(core, d, list(first))
    [second] = calls(_next(core, d))
    assert users(second) == ["c", "e"]


def test_a_rank_too_large_for_max_rows_runs_alone() -> None:
    core, d, _ = make(hbm_prefixes=12, settings=batched(max_batch_rows=ROWS - 1))
    resident(d, "a", "b")
    chunk = holding(core, d, "g")
    d.rank(hit("a"))
    d.rank(hit("b"))
    [first] = calls(release(core, d, chunk))
    assert users(first) == ["a"]


def test_a_rank_past_its_deadline_or_cancelled_is_not_in_the_batch() -> None:
    core, d, clock = make(hbm_prefixes=12, settings=batched())
    resident(d, "a", "b", "c", "e")
    chunk = holding(core, d, "g")
    a = d.rank(hit("a"))
    late = d.rank(hit("b"), deadline=clock.now + 0.5)
    left = d.rank(hit("c"))
    e = d.rank(hit("e"))
    d.feed(core.cancel(left))
    clock.now += 1.0  # b's caller has given up by the time the worker frees
    [first] = calls(release(core, d, chunk))
    assert users(first) == ["a", "e"]
    assert isinstance(d.answers[late].error, DeadlineExceeded)
    assert left not in d.answers  # its caller left: nobody to answer
    finish(core, d, list(first))
    assert {d.result(a).outcome, d.result(e).outcome} == {CacheOutcome.HBM_HIT}  # type: ignore[union-attr]


def test_a_miss_keeps_its_place_a_batch_does_not_jump_it() -> None:
    """Rank order a (hit), m (miss), b (hit): m's one call (its full inference, keeping the
    prefix) is no cached Rank's scoring step, so a's call stops before it, and b's waits behind
    it."""
    core, d, clock = make(hbm_prefixes=12, settings=batched())
    resident(d, "a", "b")
    chunk = holding(core, d, "g")
    d.rank(hit("a"))
    clock.now += 1.0
    miss = d.rank(R(prefix("m")))
    clock.now += 1.0
    d.rank(hit("b"))
    [first] = calls(release(core, d, chunk))
    assert users(first) == ["a"]
    finish(core, d, list(first))
    [full] = calls(_next(core, d))
    assert [(type(j.spec), j.priority) for j in full] == [(FullForward, Priority.RANK)]
    [after] = calls(release(core, d, full[0]))
    assert users(after) == ["b"]
    assert d.result(miss).outcome is CacheOutcome.MISS  # type: ignore[union-attr]


def test_misses_computed_in_one_call_batch_together_and_each_keeps_its_prefix() -> None:
    core, d, _ = make(settings=batched())
    x = d.rank(R(prefix("x")))
    d.feed(core.worker_free())
    [running] = d.running
    assert isinstance(running.spec, FullForward) and running.spec.keep
    y, z = d.rank(R(prefix("y"))), d.rank(R(prefix("z")))
    [call] = calls(release(core, d, running))
    assert users(call) == ["y", "z"]
    assert all(isinstance(j.spec, FullForward) and j.spec.keep for j in call)
    finish(core, d, list(call))
    for rid, user in zip((x, y, z), "xyz", strict=True):
        assert d.result(rid).outcome is CacheOutcome.MISS  # type: ignore[union-attr]
        assert core.store.tier_of(core.key(prefix(user))) is Tier.HBM


def test_full_inferences_batch_together() -> None:
    core, d, _ = make(relay=False, settings=batched())
    x = d.rank(R(prefix("x")))
    d.feed(core.worker_free())
    [running] = d.running
    assert isinstance(running.spec, FullForward)
    y, z = d.rank(R(prefix("y"))), d.rank(R(prefix("z")))
    [call] = calls(release(core, d, running))
    assert users(call) == ["y", "z"] and all(isinstance(j.spec, FullForward) for j in call)
    finish(core, d, list(call))
    for rid in (x, y, z):
        assert d.result(rid).outcome is CacheOutcome.BYPASS  # type: ignore[union-attr]


def test_a_failed_batch_runs_its_ranks_again_alone_in_their_places() -> None:
    core, d, _ = make(hbm_prefixes=12, settings=batched())
    resident(d, "a", "b", "c")
    chunk = holding(core, d, "g")
    rids = [d.rank(hit(u)) for u in "abc"]
    [call] = calls(release(core, d, chunk))
    assert users(call) == ["a", "b", "c"]
    d.running = []
    actions = core.batch_failed(call, RuntimeError("device out of memory"))
    assert actions == [] and core.queued() == 3 + 1
    singles = []
    for _ in range(3):  # each alone, in its place, before the background prefill
        [(job,)] = calls(_next(core, d))
        singles.append(job)
        d.running = []
        if users([job]) == ["b"]:  # the bad one fails alone
            d.feed(core.step_failed(job, ValueError("bad input")))
        else:
            d.feed(core.step_done(job, "scores"))
    assert users(singles) == ["a", "b", "c"]
    answers: list[Answer] = [d.answers[rid] for rid in rids]
    assert [type(a.error) for a in answers] == [type(None), ValueError, type(None)]


def test_max_batch_one_runs_every_rank_alone_as_before() -> None:
    """The safety valve: with max_batch_requests=1 no call is a batch, and the steps run in the
    same order as the batched run's, each Rank alone."""
    shapes: dict[int, list[tuple[str, ...]]] = {}
    for size in (1, 8):
        core, d, _ = make(hbm_prefixes=12, settings=batched(max_batch_requests=size))
        resident(d, "a", "b", "c")
        chunk = holding(core, d, "g")
        for u in "abc":
            d.rank(hit(u))
        release(core, d, chunk)
        d.run()
        assert (size == 1) is not any(isinstance(a, RunBatch) for a in d.log)
        shapes[size] = [
            tuple(users(jobs)) if isinstance(jobs[0].spec, Score) else ("prefill",)
            for jobs in calls(d.log)
        ]
    assert shapes[1][-5:] == [("prefill",), ("a",), ("b",), ("c",), ("prefill",)]
    assert shapes[8][-3:] == [("prefill",), ("a", "b", "c"), ("prefill",)]


def test_a_rank_joins_only_while_the_call_still_ends_before_every_deadline_in_it() -> None:
    """Every Rank of a call is answered when the call ends: b, queued behind a, joins a's call
    only if the pair, predicted from now, still ends before a's deadline."""
    core, d, clock = make(hbm_prefixes=12, settings=batched())
    resident(d, "a", "b")
    one = batch_ms(COST, [CallShape(CACHED, 8, 16)]) / 1e3
    two = batch_ms(COST, [CallShape(CACHED, 8, 16)] * 2) / 1e3
    assert one < two
    chunk = holding(core, d, "g")
    a = d.rank(hit("a"), deadline=clock.now + (one + two) / 2)  # alone it ends in time
    b = d.rank(hit("b"))
    [first] = calls(release(core, d, chunk))
    assert users(first) == ["a"]  # with b, a's answer would come after a's deadline
    finish(core, d, list(first))
    [second] = calls(_next(core, d))
    assert users(second) == ["b"]
    finish(core, d, list(second))
    assert {d.result(a).outcome, d.result(b).outcome} == {CacheOutcome.HBM_HIT}  # type: ignore[union-attr]
    # With room in a's deadline for both, they share one call.
    core, d, clock = make(hbm_prefixes=12, settings=batched())
    resident(d, "a", "b")
    chunk = holding(core, d, "g")
    d.rank(hit("a"), deadline=clock.now + 2 * two)
    d.rank(hit("b"), deadline=clock.now + 2 * two)
    [both] = calls(release(core, d, chunk))
    assert users(both) == ["a", "b"]


def test_ranks_that_save_little_batch_only_behind_a_backlog() -> None:
    """Sharing a call ends every Rank in it last: where a joiner saves less than half its own
    call (this cost model saves nothing), a burst of two or three queued Ranks runs one by one,
    as unbatched; from `batch_backlog` queued Ranks (the one taken included) they share."""
    core, d, _ = make(hbm_prefixes=12)  # the default settings: batch_backlog 4
    assert core.settings.batch_backlog == 4 and COST.batch_saving_ms == 0
    resident(d, *"abcdefg")
    chunk = holding(core, d, "z")
    for u in "abc":
        d.rank(hit(u))
    [first] = calls(release(core, d, chunk))
    assert users(first) == ["a"]  # a backlog of 3: a alone
    finish(core, d, list(first))
    [second] = calls(_next(core, d))
    assert users(second) == ["b"]
    for u in "defg":
        d.rank(hit(u))
    finish(core, d, list(second))
    [third] = calls(_next(core, d))
    assert users(third) == ["c", "d", "e", "f", "g"]  # a backlog of 5: one call


def test_ranks_that_save_half_their_call_batch_at_any_load() -> None:
    """Where the cost model says a joiner saves at least half its own call, two queued Ranks
    end sooner on average together than one by one, so they share a call with no backlog."""
    single = COST.shape_ms(CallShape(CACHED, 8, 16))
    for saving, together in ((single / 2, True), (single / 2 - 1e-6, False)):
        core, d, _ = make(hbm_prefixes=12, cost=replace(COST, batch_saving_ms=saving))
        resident(d, "a", "b")
        chunk = holding(core, d, "z")
        d.rank(hit("a"))
        d.rank(hit("b"))
        first = calls(release(core, d, chunk))[0]
        assert users(first) == (["a", "b"] if together else ["a"]), saving


def test_a_batched_call_is_observed_once_with_its_shapes_and_each_rank_carries_its_size() -> None:
    """What the cost learner and the spans see: a batch's time once, as one `BatchComputed` of
    its Ranks' shapes in call order (no `Computed` of any of its Ranks alone, whose time the
    call's is not); every Rank's `JobEnded` names the call it ran in. A Rank alone is a call
    of one, timed as before."""
    seen: list[Observation] = []
    core, d, _ = make(hbm_prefixes=12, settings=batched(), observe=seen.append)
    resident(d, "a", "b", "c", "e")
    chunk = holding(core, d, "g")
    for u in "abc":
        d.rank(hit(u))
    [call] = calls(release(core, d, chunk))
    seen.clear()
    d.running = []
    for i, job in enumerate(call):
        d.feed(core.step_done(job, "scores", seconds=0.25))
        batch_seen = [o for o in seen if isinstance(o, BatchComputed)]
        assert len(batch_seen) == (1 if i == len(call) - 1 else 0)  # once the call is back
    shape = CallShape(CACHED, 8, 16)
    [batch] = [o for o in seen if isinstance(o, BatchComputed)]
    assert batch == BatchComputed(ScoringCall(Work.RANK, (shape,) * 3), 0.25)
    assert not [o for o in seen if isinstance(o, Computed)]
    ended = [o for o in seen if isinstance(o, JobEnded)]
    assert [o.job for o in ended] == list(call)
    assert {(o.call.requests, o.call.rows) for o in ended if o.call} == {(3, 3 * ROWS)}
    assert all(o.call is batch.call for o in ended)
    # Alone: its own Computed, a call of one; no BatchComputed.
    seen.clear()
    d.rank(hit("e"))
    [(alone,)] = calls(_next(core, d))
    d.running = []
    d.feed(core.step_done(alone, "scores", seconds=0.125))
    assert [o for o in seen if isinstance(o, Computed)] == [
        Computed(Work.RANK, CACHED + 8, CACHED, 16, 0.125)
    ]
    assert not [o for o in seen if isinstance(o, BatchComputed)]
    [end] = [o for o in seen if isinstance(o, JobEnded)]
    assert end.call == ScoringCall(Work.RANK, (shape,))
    assert (end.call.requests, end.call.rows) == (1, ROWS)


def test_the_rank_wait_a_ranker_reports_is_its_queued_ranks_in_the_calls_it_will_run() -> None:
    """Describe's `queued_rank_ms` (the trigger's wait before a Rank's own compute) prices the
    queued Ranks in the calls the core then runs: five Ranks saving a little each, at most three
    a call, run as three together (a backlog of five), then one by one (a backlog under four)."""
    single = COST.shape_ms(CallShape(CACHED, 8, 16))
    saving = single / 4  # under half its call: a backlog is needed
    core, d, _ = make(
        hbm_prefixes=12,
        cost=replace(COST, batch_saving_ms=saving),
        settings=replace(SETTINGS, max_batch_requests=3),
    )
    resident(d, *"abcde")
    chunk = holding(core, d, "z")
    for u in "abcde":
        d.rank(hit(u))
    reported = core.stats().queued_rank_ms
    assert abs(core.queues.queued_rank_ms() - 5 * single) < 1e-9  # one call each
    ran: list[tuple[Job, ...]] = calls(release(core, d, chunk))
    while isinstance(ran[-1][0].spec, Score):  # then z's next chunk
        finish(core, d, list(ran[-1]))
        ran += calls(_next(core, d))
    ran = ran[:-1]
    assert [users(c) for c in ran] == [["a", "b", "c"], ["d"], ["e"]]
    predicted = sum(batch_ms(core.cost_model, [CallShape(CACHED, 8, 16)] * len(c)) for c in ran)
    assert abs(reported - predicted) < 1e-9, (reported, predicted)
    assert abs(reported - (5 * single - 2 * saving)) < 1e-9
    # One Rank a call: the sum of single calls, as before batching.
    core, d, _ = make(
        hbm_prefixes=12,
        cost=replace(COST, batch_saving_ms=saving),
        settings=replace(SETTINGS, max_batch_requests=1),
    )
    resident(d, *"ab")
    holding(core, d, "z")
    d.rank(hit("a"))
    d.rank(hit("b"))
    assert core.stats().queued_rank_ms == 2 * single
