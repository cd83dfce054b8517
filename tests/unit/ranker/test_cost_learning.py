"""Cost model robustness: the fit resists noise and outliers, the learner follows served
timings, republication is rate-limited, and calibrations on one host never overlap."""

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from relaygr.cost import CostModel
from relaygr.etcd.errors import EtcdRejected
from services.ranker.config import RankerConfig
from services.ranker.cost_fit import Sample, fit_cost_model, relative_errors
from services.ranker.cost_learner import CostLearner, Republisher, changed_materially
from services.ranker.cost_model import calibrate
from services.ranker.engine import CacheOutcome, EngineSettings, RankerEngine
from services.ranker.host_lock import host_lock
from services.ranker.kv_store import KVStore
from services.ranker.model import RankingModel
from services.ranker.observer import NoopObserver, Work
from services.ranker.server import keep_learning
from tests.polling import eventually

from .factories import longer, prefix, rank_input, tiny_config
from .test_engine import (
    CANDIDATES,
    KV_BYTES,
    MODEL,
    TOKENS,
    USER_FEATURES,
    Clock,
    running_engine,
)

# Shaped like the default model on one CPU core (see docs/benchmarks.md "Cost model").
TRUTH = CostModel(8.0, 0.16, 3.6e-5, 2.5e-4, reload_ms_per_mb=0.3)
LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
PROBES = [(t, c) for t in (256, 1000, 2048, 6000, 8192) for c in (0, 64, 128)]


def timed_runs(
    model: CostModel, rng: np.random.Generator, noise: float, outliers: float, repeats: int = 3
) -> list[Sample]:
    """Prefill and full-inference runs of `model` across LENGTHS: each off by Gaussian `noise`
    (relative), and a share `outliers` of them slowed 2-5x (another process took the core)."""
    samples = []
    for _ in range(repeats):
        for tokens in LENGTHS:
            for candidates in (0, 64):
                ms = model.full_ms(tokens, candidates) * float(rng.normal(1.0, noise))
                if rng.random() < outliers:
                    ms *= float(rng.uniform(2.0, 5.0))
                samples.append(Sample(tokens, candidates, ms))
    return samples


def assert_predicts(fitted: CostModel, truth: CostModel, rel: float) -> None:
    for tokens, candidates in PROBES:
        assert fitted.full_ms(tokens, candidates) == pytest.approx(
            truth.full_ms(tokens, candidates), rel=rel
        ), (tokens, candidates)


def test_fit_recovers_known_costs_within_10_percent_despite_noise_and_outliers(
    rng: np.random.Generator,
) -> None:
    # Five timed runs per shape: with three (36 samples, a sixth of them outliers) the worst
    # probe missed 10% in 5 of 400 seeds (RELAYGR_SEED=1571418798 drew 10.3%); with five, in
    # none of the same 400.
    samples = timed_runs(TRUTH, rng, noise=0.05, outliers=0.15, repeats=5)
    fitted = fit_cost_model(samples, reload_ms_per_mb=0.3)
    assert_predicts(fitted, TRUTH, rel=0.10)
    assert fitted.samples == len(samples)
    # The published error is the inliers' spread, not the outliers' 2-5x.
    assert fitted.median_abs_rel_error < 0.10


def test_plain_least_squares_is_what_outliers_break(rng: np.random.Generator) -> None:
    # The control: the same kind of data through an unweighted fit misses by far more, so the
    # test above checks robustness rather than easy data.
    samples = timed_runs(TRUTH, rng, noise=0.05, outliers=0.15)
    rows = np.array([s.features() for s in samples])
    coef, *_ = np.linalg.lstsq(rows, np.array([s.ms for s in samples]), rcond=None)
    plain = CostModel(*(float(c) for c in coef), reload_ms_per_mb=0.3)
    worst = max(abs(plain.full_ms(t, c) / TRUTH.full_ms(t, c) - 1) for t, c in PROBES if t >= 1000)
    fitted = fit_cost_model(samples, reload_ms_per_mb=0.3)
    best = max(abs(fitted.full_ms(t, c) / TRUTH.full_ms(t, c) - 1) for t, c in PROBES if t >= 1000)
    assert best < worst


# Cached-rank terms shaped like the small model's on one CPU core (calibrated, 2026-12-05).
CACHED = dataclasses.replace(
    TRUTH, cached_fixed_ms=2.8, cached_per_row_ms=0.037, cached_per_key_ms=1e-4,
    cached_per_row_key_ms=2e-5,
)  # fmt: skip


def cached_ranks(model: CostModel) -> list[Sample]:
    """Ranks on cached prefixes of every length, as calibration times them: 64 candidates with
    no short-term behaviours, 128 after 128 short-term behaviours."""
    return [
        Sample(t + short, candidates, model.rank_ms(t, short, candidates), cached_tokens=t)
        for t in LENGTHS
        for short, candidates in ((0, 64), (128, 128))
    ]


def test_cached_ranks_fit_their_own_terms_and_leave_the_full_inference_ones() -> None:
    # Extensions (prefill(t) - prefill(base), no fixed cost) fit the full-inference terms with
    # the prefills and full inferences; the cached ranks, their own terms. Both recovered.
    samples = [Sample(t, c, CACHED.full_ms(t, c)) for t in LENGTHS for c in (0, 64)]
    samples += [
        Sample(t, 0, CACHED.prefill_ms(t) - CACHED.prefill_ms(t - 512), cached_tokens=t - 512)
        for t in LENGTHS[1:]
    ]
    samples += cached_ranks(CACHED)
    fitted = fit_cost_model(samples, reload_ms_per_mb=0.3)
    assert_predicts(fitted, CACHED, rel=0.01)
    for t in (300, 2048, 6000, 8192):
        for short, candidates in ((32, 128), (128, 128), (64, 32)):
            assert fitted.rank_ms(t, short, candidates) == pytest.approx(
                CACHED.rank_ms(t, short, candidates), rel=0.01
            ), (t, short, candidates)
    assert float(np.max(relative_errors(fitted, samples))) < 0.01
    # Timed the same way, the full-inference terms alone price the cached rank far off: what
    # the cached-rank terms are for.
    assert TRUTH.rank_ms(6000, 64, 128) > 2 * CACHED.rank_ms(6000, 64, 128)


def test_too_few_cached_ranks_leave_their_terms_unfitted() -> None:
    # Four terms from a handful of served Ranks would be noise fitted exactly: below the
    # minimum they stay 0 and the full-inference terms price a cached rank, as before them.
    samples = [Sample(t, c, TRUTH.full_ms(t, c)) for t in LENGTHS for c in (0, 64)]
    samples += cached_ranks(CACHED)[:5]
    fitted = fit_cost_model(samples, reload_ms_per_mb=0.3)
    assert not fitted.prices_cached_ranks
    assert fitted.rank_ms(2048, 64, 128) == pytest.approx(TRUTH.rank_ms(2048, 64, 128), rel=0.01)
    assert fit_cost_model(
        samples + cached_ranks(CACHED)[5:6], reload_ms_per_mb=0.3
    ).prices_cached_ranks


def test_the_cached_rank_terms_price_only_scoring_on_a_cached_prefix() -> None:
    # A full inference, a prefill and its first chunk start from nothing; an extension chunk
    # scores no candidates: all keep the full-inference terms.
    assert CACHED.rank_ms(0, 2048, 64) == TRUTH.full_ms(2048, 64)
    assert CACHED.rank_ms(0, 512, 0) == TRUTH.prefill_ms(512)
    assert CACHED.rank_ms(1024, 512, 0) == TRUTH.rank_ms(1024, 512, 0)
    # rows = 32 + 128, keys = 1024 + 32
    assert CACHED.rank_ms(1024, 32, 128) == pytest.approx(
        2.8 + 0.037 * 160 + 1e-4 * 1056 + 2e-5 * 160 * 1056
    )


def test_online_update_moves_a_wrong_model_to_served_timings(rng: np.random.Generator) -> None:
    # Calibrated while another ranker shared the core: every timing 2.5x too slow.
    wrong = CostModel(20.0, 0.4, 9e-5, 6.2e-4, reload_ms_per_mb=0.3)
    calibration = timed_runs(wrong, rng, noise=0.02, outliers=0.0, repeats=1)
    learner = CostLearner(calibration, fit_cost_model(calibration, 0.3), refit_after=8)
    before = max(abs(learner.model.full_ms(t, c) / TRUTH.full_ms(t, c) - 1) for t, c in PROBES)
    assert learner.refit() is None  # nothing served yet: nothing to learn
    # A few seconds of traffic: served prefills and misses of assorted lengths, a few disturbed.
    # Once they outnumber the calibration's points, those are the outliers.
    for _ in range(48):
        tokens = int(rng.choice(LENGTHS))
        candidates = int(rng.choice((0, 64, 128)))
        ms = TRUTH.full_ms(tokens, candidates) * float(rng.normal(1.0, 0.05))
        learner.observe(Sample(tokens, candidates, ms * (3.0 if rng.random() < 0.1 else 1.0)))
    refitted = learner.refit()
    assert refitted is not None and refitted is learner.model
    assert_predicts(refitted, TRUTH, rel=0.10)
    after = max(abs(refitted.full_ms(t, c) / TRUTH.full_ms(t, c) - 1) for t, c in PROBES)
    assert before > 1.0 and after < 0.1
    assert refitted.samples == len(calibration) + 48
    assert learner.refit() is None  # no new sample since


def test_served_cached_ranks_refit_their_terms_and_not_the_full_inference_ones(
    rng: np.random.Generator,
) -> None:
    # Calibrated cached ranks 3x too slow; the Ranks served on cached prefixes teach their own
    # terms, and the full-inference terms keep the calibration's (no miss was served).
    slow = dataclasses.replace(
        CACHED, cached_fixed_ms=3 * 2.8, cached_per_row_ms=3 * 0.037, cached_per_row_key_ms=6e-5
    )
    calibration = [Sample(t, c, TRUTH.full_ms(t, c)) for t in LENGTHS for c in (0, 64)]
    calibration += cached_ranks(slow)
    learner = CostLearner(calibration, fit_cost_model(calibration, 0.3), refit_after=8)
    assert learner.model.rank_ms(4096, 64, 128) == pytest.approx(
        slow.rank_ms(4096, 64, 128), rel=0.01
    )
    for _ in range(48):
        cached = int(rng.integers(200, 8192))
        short, candidates = int(rng.integers(32, 129)), 128
        ms = CACHED.rank_ms(cached, short, candidates) * float(rng.normal(1.0, 0.03))
        learner.observe(Sample(cached + short, candidates, ms, cached_tokens=cached))
    refitted = learner.refit()
    assert refitted is not None
    for t in (500, 3000, 8000):
        assert refitted.rank_ms(t, 64, 128) == pytest.approx(CACHED.rank_ms(t, 64, 128), rel=0.1)
    assert_predicts(refitted, TRUTH, rel=0.01)


def test_a_host_that_became_faster_prices_shapes_it_has_not_served_since_calibration(
    rng: np.random.Generator,
) -> None:
    # Calibrated while the core was shared: every cached rank 3x too slow. The Ranks served
    # since all score 128 candidates after 64 short-term behaviours; a Rank of 64 candidates
    # and none (a calibration shape, never served) is priced at the host's speed now too, not
    # the calibration's, and the full-inference terms keep theirs (no miss was served).
    slow = dataclasses.replace(
        CACHED, cached_fixed_ms=3 * 2.8, cached_per_row_ms=3 * 0.037, cached_per_key_ms=3e-4,
        cached_per_row_key_ms=6e-5,
    )  # fmt: skip
    calibration = [Sample(t, c, TRUTH.full_ms(t, c)) for t in LENGTHS for c in (0, 64)]
    calibration += cached_ranks(slow)
    learner = CostLearner(calibration, fit_cost_model(calibration, 0.3), refit_after=8)
    for _ in range(16):
        cached = int(rng.integers(200, 8192))
        ms = CACHED.rank_ms(cached, 64, 128) * float(rng.normal(1.0, 0.02))
        learner.observe(Sample(cached + 64, 128, ms, cached_tokens=cached))
    refitted = learner.refit()
    assert refitted is not None
    for t in (500, 3000, 8000):
        assert refitted.rank_ms(t, 0, 64) == pytest.approx(CACHED.rank_ms(t, 0, 64), rel=0.1)
        assert refitted.rank_ms(t, 64, 128) == pytest.approx(CACHED.rank_ms(t, 64, 128), rel=0.1)
    assert_predicts(refitted, TRUTH, rel=0.01)
    assert refitted.samples == len(calibration) + 16


def test_learner_keeps_only_the_most_recent_served_samples() -> None:
    learner = CostLearner([Sample(256, 0, 50.0)], TRUTH, capacity=4, refit_after=1)
    for i in range(10):
        learner.observe(Sample(256 * (i + 1), 0, TRUTH.prefill_ms(256 * (i + 1))))
    learner.observe(Sample(256, 0, 0.0))  # not a timing: ignored
    assert learner.served == 4
    refitted = learner.refit()
    assert refitted is not None and refitted.samples == 5


def test_republication_waits_for_a_material_change_and_the_interval() -> None:
    probes = [(256, 64), (8192, 64)]
    publisher = Republisher(TRUTH, now=0.0, probes=probes, threshold=0.1, min_interval_s=30.0)
    slower = CostModel(8.0, 0.16 * 1.5, 3.6e-5 * 1.5, 2.5e-4, 0.3)
    nudged = CostModel(8.0, 0.16 * 1.02, 3.6e-5, 2.5e-4, 0.3)
    assert changed_materially(TRUTH, slower, probes, 0.1)
    assert not changed_materially(TRUTH, nudged, probes, 0.1)
    assert not publisher.offer(slower, now=10.0)  # too soon after the last publication
    assert not publisher.offer(nudged, now=40.0)  # not material
    assert publisher.offer(slower, now=40.0)
    assert publisher.published is slower
    assert not publisher.offer(TRUTH, now=50.0)  # material, but again too soon
    assert publisher.offer(TRUTH, now=70.0)


def test_host_lock_serialises_two_calibrations(tmp_path: Path) -> None:
    model = RankingModel(tiny_config(), seed=1)
    intervals: list[tuple[float, float]] = []
    record = threading.Lock()

    def calibrating() -> None:
        with host_lock(tmp_path):
            start = time.perf_counter()
            calibrate(model, lengths=(32, 64), candidates=8)
            end = time.perf_counter()
        with record:
            intervals.append((start, end))

    threads = [threading.Thread(target=calibrating) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(intervals) == 2
    first, second = sorted(intervals)
    assert first[1] <= second[0]  # the second began only after the first ended
    assert (tmp_path / "relaygr-calibration.lock").exists()


@dataclass
class Timings(NoopObserver):
    """Records every compute timing the engine reports."""

    seen: list[tuple[Work, int, int | None, int, float]] = field(default_factory=list)

    def computed(
        self, work: Work, tokens: int, cached_tokens: int | None, candidates: int, seconds: float
    ) -> None:
        self.seen.append((work, tokens, cached_tokens, candidates, seconds))


def test_engine_reports_the_compute_of_each_job(rng: np.random.Generator) -> None:
    clock = Clock()
    store = KVStore(1 << 30, 1 << 30, dram_ttl=600.0, clock=clock, to_host=lambda kv: kv.to("cpu"))
    settings = EngineSettings(
        True, relay_window_s=30.0, prefill_chunk_tokens=64, max_queued_ranks=8,
        max_queued_prefills=8,
    )  # fmt: skip
    observer = Timings()
    first = rank_input(rng, prefix(rng, TOKENS, user_id="a"))
    again = rank_input(rng, longer(rng, first.prefix, 40))
    engine = RankerEngine(MODEL, store, TRUTH, settings, observer, clock=clock)
    try:

        async def scenario() -> None:
            await engine.rank(first, None)  # a miss: one call, its full inference
            await engine.rank(again, None)  # the user came back with more: extend, then rank

        asyncio.run(scenario())
    finally:
        engine.stop()
    p1, p2 = first.prefix.num_tokens, again.prefix.num_tokens
    assert [s[:4] for s in observer.seen] == [
        (Work.FULL_FORWARD, first.history_tokens, None, CANDIDATES),
        (Work.EXTEND, p2, p1, 0),
        (Work.RANK, again.history_tokens, p2, CANDIDATES),
    ]
    assert all(s[4] > 0 for s in observer.seen)


class CountingLearner(CostLearner):
    """A learner that counts its refits: once a second has begun, the first one's model has
    been handed on (`keep_learning` hands each refit on before it waits for the next)."""

    refits = 0

    def refit(self) -> CostModel | None:
        self.refits += 1
        return super().refit()


def test_the_engine_plans_with_each_refitted_cost_model(rng: np.random.Generator) -> None:
    """The ranker's refit loop (`server.keep_learning`) hands each refit to the engine: a host
    copy that the calibrated model reloads (calibrated while the core was shared, compute
    looked dear) is recomputed once served timings show compute is cheap."""
    # A host copy reloads in 11.5 ms; a prefill of it takes 105 ms calibrated, 2 ms served.
    calibrated = CostModel(1.0, 1.0, 1e-6, 1e-5, reload_ms_per_mb=100.0)
    served = CostModel(1.0, 0.01, 1e-6, 1e-5, reload_ms_per_mb=100.0)
    calibration = timed_runs(calibrated, rng, noise=0.02, outliers=0.0, repeats=1)
    learner = CountingLearner(calibration, calibrated, refit_after=8)
    for sample in timed_runs(served, rng, noise=0.02, outliers=0.0, repeats=4):
        learner.observe(sample)  # what the engine's compute timings feed it (`LearnerSink`)
    cfg = RankerConfig(plaintext=True, cost_refit_interval_s=0.001)
    a, b = (rank_input(rng, prefix(rng, TOKENS, user_id=u)) for u in ("a", "b"))
    with running_engine(hbm_prefixes=1.5, cost=calibrated) as (engine, _):

        async def scenario() -> list[CacheOutcome]:
            outcomes = []
            for request in (a, b, a):  # each Rank pushes the other user's prefix to the host
                outcomes.append((await engine.rank(request, None)).outcome)
            learning = asyncio.create_task(keep_learning(engine, learner, cfg, None))
            try:
                await eventually(lambda: learner.refits >= 2, "the first refit handed on")
            finally:
                learning.cancel()
            outcomes.append((await engine.rank(b, None)).outcome)
            return outcomes

        outcomes = asyncio.run(scenario())
    refitted = learner.model
    # The premise: the calibrated model reloads a host copy, the refitted one recomputes it.
    assert calibrated.reload_ms(KV_BYTES) < calibrated.prefill_ms(TOKENS + USER_FEATURES)
    assert refitted.reload_ms(KV_BYTES) > refitted.prefill_ms(TOKENS + USER_FEATURES)
    # a's third Rank reloaded its host copy (calibrated); b's, after the refit, recomputes it.
    assert outcomes == [CacheOutcome.MISS] * 2 + [CacheOutcome.DRAM_HIT, CacheOutcome.MISS]


class AlternatingLearner(CostLearner):
    """A learner whose every refit differs materially from the one before (TRUTH, then a
    model half again slower, and back)."""

    def __init__(self) -> None:
        super().__init__([Sample(256, 0, 50.0)], TRUTH)
        self._slower = CostModel(8.0, 0.16 * 1.5, 3.6e-5 * 1.5, 2.5e-4, 0.3)

    def refit(self) -> CostModel | None:
        self.model = self._slower if self.model is TRUTH else TRUTH
        return self.model


def test_a_republication_etcd_refuses_leaves_the_refit_loop_running() -> None:
    """etcd refuses a put under a lease that lapsed before its keeper noticed (the keeper's
    next lease then puts the newest record): the ranker goes on refitting, and republishes the
    next change, rather than ending its refits for good at the first refusal."""
    published: list[CostModel] = []
    refused: list[CostModel] = []

    async def republish(model: CostModel) -> None:
        if not refused:
            refused.append(model)
            raise EtcdRejected("etcdserver: requested lease not found")
        published.append(model)

    ticks = iter(range(0, 10**9, 60))  # a minute between refits: every change may go
    learner = AlternatingLearner()
    cfg = RankerConfig(plaintext=True, cost_refit_interval_s=0.001)
    with running_engine() as (engine, _):

        async def scenario() -> None:
            learning = asyncio.create_task(
                keep_learning(engine, learner, cfg, republish, clock=lambda: float(next(ticks)))
            )
            try:
                await eventually(lambda: published or learning.done(), "a republication")
                assert not learning.done(), learning.exception()
            finally:
                learning.cancel()

        asyncio.run(scenario())
    assert len(refused) == 1
    assert published and published[0] is not refused[0]  # the next change, after the refusal


def test_a_served_timing_the_calibration_prices_at_nothing_does_not_retime_it() -> None:
    # A fit may zero a term (non-negative least squares): a served shape it then prices at 0 ms
    # says nothing about the host's speed, and must not fail the refit.
    calibration = [Sample(t, c, TRUTH.full_ms(t, c)) for t in LENGTHS for c in (0, 64)]
    free = CostModel(0.0, 0.0, 0.0, 0.0, reload_ms_per_mb=0.3)
    learner = CostLearner(calibration, free, refit_after=8)
    for tokens in LENGTHS + LENGTHS[:2]:
        learner.observe(Sample(tokens, 0, TRUTH.full_ms(tokens, 0)))
    refitted = learner.refit()
    assert refitted is not None
    assert_predicts(refitted, TRUTH, rel=0.01)
