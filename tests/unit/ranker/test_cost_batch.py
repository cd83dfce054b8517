"""The cost model's batch term: batch_ms of a batch's shape, its fit on synthetic timings, and
the ranker record that carries it to the trigger and the simulator."""

import dataclasses
import json

import numpy as np
import pytest

from relaygr.cluster import RankerRecord
from relaygr.cost import CallShape, CostModel, batch_ms
from services.ranker.config import RankerConfig
from services.ranker.cost_fit import (
    BatchSample,
    Sample,
    ServedBatch,
    fit_batch_saving,
    fit_cost_model,
)
from services.ranker.cost_learner import CostLearner, changed_materially
from services.ranker.cost_model import measure_batches
from services.ranker.model import RankingModel
from services.ranker.outcomes import Work
from services.ranker.server import LearnerSink, ranker_record

from ..test_cluster import ranker
from .factories import tiny_config

COST = CostModel(2.0, 0.05, 2e-5, 1e-4, reload_ms_per_mb=0.3)


def test_one_request_costs_its_single_call() -> None:
    shape = CallShape(1024, 64, 256)
    assert batch_ms(COST, [shape]) == COST.rank_ms(1024, 64, 256)
    assert batch_ms(COST, [CallShape(0, 500, 128)]) == pytest.approx(COST.full_ms(500, 128))
    assert batch_ms(COST, [CallShape(0, 500, 0)]) == pytest.approx(COST.prefill_ms(500))
    assert batch_ms(COST, []) == 0.0


def test_a_batch_follows_its_shape_and_saves_per_extra_request() -> None:
    shapes = [CallShape(256, 64, 128), CallShape(4096, 64, 256), CallShape(1024, 0, 200)]
    alone = sum(COST.shape_ms(s) for s in shapes)
    assert batch_ms(COST, shapes) == pytest.approx(alone)  # saving not known: no saving
    saving = dataclasses.replace(COST, batch_saving_ms=1.5)
    assert batch_ms(saving, shapes) == pytest.approx(alone - 2 * 1.5)
    # A longer prefix in the batch costs more; a request more costs more.
    longer = [*shapes[:2], CallShape(2048, 0, 200)]
    assert batch_ms(saving, longer) > batch_ms(saving, shapes)
    assert batch_ms(saving, [*shapes, shapes[0]]) > batch_ms(saving, shapes)


def test_a_batch_never_costs_less_than_its_slowest_request() -> None:
    huge = dataclasses.replace(COST, batch_saving_ms=1e6)
    shapes = [CallShape(4096, 64, 256), CallShape(16, 0, 8)]
    assert batch_ms(huge, shapes) == pytest.approx(COST.shape_ms(shapes[0]))


def _samples(
    rng: np.random.Generator, saving: float, noise: float, count: int
) -> list[BatchSample]:
    out = []
    for _ in range(count):
        size = int(rng.integers(2, 17))
        shapes = tuple(
            CallShape(int(rng.integers(1, 4097)), 64, int(rng.integers(128, 257)))
            for _ in range(size)
        )
        singles = sum(COST.shape_ms(s) for s in shapes) * float(rng.normal(1.0, noise))
        batch = (sum(COST.shape_ms(s) for s in shapes) - saving * (size - 1)) * float(
            rng.normal(1.0, noise)
        )
        out.append(BatchSample(shapes, batch, singles))
    return out


def test_fit_recovers_the_saving_despite_outliers(rng: np.random.Generator) -> None:
    samples = _samples(rng, saving=3.0, noise=0.002, count=40)
    # Foreign load: a few batches (or their singles) measured several times too slow.
    for i in range(0, 40, 8):
        s = samples[i]
        samples[i] = dataclasses.replace(s, batch_ms=5 * s.batch_ms)
    fitted = fit_batch_saving(COST, samples)
    print(f"fitted saving {fitted.batch_saving_ms:.3f} ms from {fitted.batch_samples} batches")
    assert fitted.batch_saving_ms == pytest.approx(3.0, rel=0.25)
    assert fitted.batch_samples == 40
    assert dataclasses.replace(fitted, batch_saving_ms=0.0, batch_samples=0) == COST


def test_fit_never_returns_a_negative_saving(rng: np.random.Generator) -> None:
    fitted = fit_batch_saving(COST, _samples(rng, saving=-2.0, noise=0.0, count=10))
    assert fitted.batch_saving_ms == 0.0
    assert fitted.batch_samples == 10


def test_fit_without_batches_of_two_or_more_leaves_the_model() -> None:
    lone = BatchSample((CallShape(10, 0, 5),), 1.0, 1.0)
    assert fit_batch_saving(COST, [lone]) is COST
    assert fit_batch_saving(COST, []) is COST


def test_batches_are_timed_on_this_device() -> None:
    model = RankingModel(tiny_config(), seed=1)
    samples = measure_batches(model, lengths=(32, 128), candidates=8, batch=3, repeats=2)
    assert len(samples) == 4
    assert all(len(s.shapes) == 3 and s.batch_ms > 0 and s.singles_ms > 0 for s in samples)
    assert {s.shapes[0].cached_tokens for s in samples} == {32, 128}


def test_the_ranker_record_carries_the_batch_term() -> None:
    record = ranker(batch_saving_ms=1.25, batch_samples=12)
    back = RankerRecord.from_json(record.to_json())
    assert back.cost_model().batch_saving_ms == 1.25
    assert back.cost_model().batch_samples == 12
    # An older ranker's record, without the fields, reads as "not known".
    older = json.loads(record.to_json())
    del older["batch_saving_ms"], older["batch_samples"]
    cost = RankerRecord.from_json(json.dumps(older).encode()).cost_model()
    assert (cost.batch_saving_ms, cost.batch_samples) == (0.0, 0)
    with pytest.raises(Exception, match="batch_saving_ms"):
        ranker(batch_saving_ms=-1.0)


def test_a_refit_from_served_timings_keeps_the_calibrated_batch_term() -> None:
    calibrated = dataclasses.replace(COST, batch_saving_ms=2.5, batch_samples=6)
    calibration = [Sample(t, c, COST.full_ms(t, c)) for t in (128, 1024, 4096) for c in (0, 64)]
    learner = CostLearner(calibration, calibrated, refit_after=1)
    learner.observe(Sample(2048, 64, COST.full_ms(2048, 64)))
    refitted = learner.refit()
    assert refitted is not None
    assert (refitted.batch_saving_ms, refitted.batch_samples) == (2.5, 6)


def _served_batches(rng: np.random.Generator, truth: CostModel, count: int) -> list[ServedBatch]:
    """`count` served calls of 2-16 cached Ranks, timed as `truth` predicts them (0.5% noise:
    on a call of 16 Ranks of ~60 ms, 0.3 ms per extra Rank), one in eight disturbed by foreign
    load (3x slower)."""
    out = []
    for _ in range(count):
        shapes = tuple(
            CallShape(int(rng.integers(1, 4097)), int(rng.integers(0, 65)), 128)
            for _ in range(int(rng.integers(2, 17)))
        )
        ms = batch_ms(truth, shapes) * float(rng.normal(1.0, 0.005))
        out.append(ServedBatch(shapes, ms * (3.0 if rng.random() < 1 / 8 else 1.0)))
    return out


def test_served_batches_refit_the_batch_term_to_what_batching_saves_now(
    rng: np.random.Generator,
) -> None:
    """Calibrated at a saving of 0.5 ms per extra request; the served batches save 3 ms. While
    the calibration's batches outnumber the served ones the calibrated term stands (a few odd
    batches move a median little); as served ones come to outnumber them, the term becomes
    theirs."""
    calibration = [Sample(t, c, COST.full_ms(t, c)) for t in (128, 1024, 4096) for c in (0, 64)]
    calibration += [Sample(t, c, COST.full_ms(t, c)) for t in (256, 2048) for c in (0, 256)]
    calibrated_batches = _samples(rng, saving=0.5, noise=0.002, count=12)
    calibrated = fit_batch_saving(fit_cost_model(calibration, 0.3), calibrated_batches)
    print(f"calibrated: {calibrated.batch_saving_ms:.3f} ms")
    assert calibrated.batch_saving_ms < 1.0
    learner = CostLearner(calibration, calibrated, refit_after=8, batches=calibrated_batches)
    truth = dataclasses.replace(COST, batch_saving_ms=3.0)
    served = _served_batches(rng, truth, 160)
    for batch in served[:8]:
        learner.observe_batch(batch)
    early = learner.refit()
    assert early is not None
    print(f"after 8 served batches: {early.batch_saving_ms:.3f} ms")
    assert early.batch_saving_ms < 1.0  # 12 calibrated against 8 served: the prior holds
    learner.observe_batch(ServedBatch((CallShape(64, 8, 16),), 5.0))  # one Rank: no batch
    assert learner.refit() is None  # and no sample
    fits = []
    for i in range(8, len(served), 8):
        for batch in served[i : i + 8]:
            learner.observe_batch(batch)
        refitted = learner.refit()
        assert refitted is not None
        fits.append(refitted.batch_saving_ms)
    print("batch saving after each refit (ms):", [round(f, 3) for f in fits])
    assert fits[-1] == pytest.approx(3.0, rel=0.05)
    assert learner.model.batch_samples == 12 + 160
    # The single-call terms stay fitted to the single calls: a batch teaches them nothing.
    assert learner.model.per_token_ms == pytest.approx(COST.per_token_ms, rel=0.01)
    assert learner.model.fixed_ms == pytest.approx(COST.fixed_ms, rel=0.01)
    # What decisions use now predicts a served call within its noise.
    shapes = served[0].shapes
    assert batch_ms(learner.model, shapes) == pytest.approx(batch_ms(truth, shapes), rel=0.05)


def test_the_learner_sink_feeds_a_batched_call_to_the_batch_term() -> None:
    """The ranker's wiring (`server.LearnerSink`): the engine's `batch_computed` is a served
    batch of the learner's, its seconds in ms."""
    calibration = [Sample(t, c, COST.full_ms(t, c)) for t in (128, 1024, 4096) for c in (0, 64)]
    learner = CostLearner(calibration, COST, refit_after=1)
    shapes = (CallShape(1024, 32, 128), CallShape(2048, 0, 96))
    saving_ms = 4.0
    seconds = (sum(COST.shape_ms(s) for s in shapes) - saving_ms) / 1e3
    LearnerSink(learner).batch_computed(Work.RANK, shapes, seconds)
    refitted = learner.refit()
    assert refitted is not None
    assert refitted.batch_saving_ms == pytest.approx(saving_ms, rel=0.01)
    assert refitted.batch_samples == 1


def test_a_refitted_batch_term_is_republished_when_it_moved_a_batch_materially() -> None:
    """A refit that moved only the batch term still reaches the membership when it changes a
    batch's prediction by over the threshold, and the ranker's record carries the term."""
    probes = [(256, 64), (4096, 64)]
    assert changed_materially(COST, dataclasses.replace(COST, batch_saving_ms=1.5), probes, 0.1)
    assert not changed_materially(COST, dataclasses.replace(COST, batch_saving_ms=0.2), probes, 0.1)
    model = RankingModel(tiny_config(), seed=1)
    refitted = dataclasses.replace(COST, batch_saving_ms=1.25, batch_samples=7)
    record = ranker_record("r0", "127.0.0.1:50061", model, refitted, RankerConfig(plaintext=True))
    cost = RankerRecord.from_json(record.to_json()).cost_model()
    assert (cost.batch_saving_ms, cost.batch_samples) == (1.25, 7)
