"""The cost model's batch term: batch_ms of a batch's shape, its fit on synthetic timings, and
the ranker record that carries it to the trigger and the simulator."""

import dataclasses
import json

import numpy as np
import pytest

from relaygr.cluster import RankerRecord
from relaygr.cost import CallShape, CostModel, batch_ms
from services.ranker.cost_fit import BatchSample, Sample, fit_batch_saving
from services.ranker.cost_learner import CostLearner
from services.ranker.cost_model import measure_batches
from services.ranker.model import RankingModel

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
