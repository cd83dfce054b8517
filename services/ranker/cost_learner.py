"""A cost model that keeps learning from the work a ranker serves, and when to republish it."""

import dataclasses
import statistics
import threading
from collections import deque
from collections.abc import Sequence

from relaygr.cost import CallShape, CostModel, batch_ms
from services.ranker.cost_fit import (
    BatchSample,
    Sample,
    ServedBatch,
    fit_batch_saving,
    fit_cost_model,
    predicted_ms,
)

# Served single calls of a kind (cached ranks; everything else) needed before the calibration's
# samples of that kind are re-timed to them (`retimed`): fewer, and one noisy timing would move
# the whole calibration.
_MIN_TO_RETIME = 8


def retimed(
    calibration: Sequence[Sample], served: Sequence[Sample], calibrated: CostModel
) -> list[Sample]:
    """The calibration's samples timed as the host runs now: each kind's (cached ranks, and
    the runs that start from nothing or extend a prefix) scaled by the median over the served
    samples of that kind of served time over what `calibrated` (the calibration's own fit)
    predicts for them, once at least `_MIN_TO_RETIME` of that kind were served.

    A host that became uniformly faster or slower moves every shape, the ones it has not served
    since calibration too. Without this, a calibration point where no served timing reaches
    (a shape served traffic never has) is no outlier to the robust fit, which then bends the
    served shapes' terms towards it (measured: cached ranks calibrated 3x slow, 48 served with
    3% noise at 128 candidates; the fit missed the served shapes by 12-19% in 8 of 400 draws).
    The shape of the calibration is kept; its level follows the host."""
    factors = {}
    for kind in (True, False):
        pairs = [(s.ms, predicted_ms(calibrated, s)) for s in served if s.is_cached_rank is kind]
        ratios = [ms / predicted for ms, predicted in pairs if predicted > 0]
        if len(ratios) >= _MIN_TO_RETIME:
            factors[kind] = statistics.median(ratios)
    return [
        dataclasses.replace(s, ms=s.ms * factors.get(s.is_cached_rank, 1.0)) for s in calibration
    ]


class CostLearner:
    """The calibrated model, refitted over its calibration and the most recent served timings.

    Invariants: the calibration's samples (single calls and batches) are kept for good; of the
    served samples, at most `capacity` single calls and `capacity` batched calls, the most
    recent (older ones leave first), so the model follows the host as its load changes while
    each refit stays a bounded fit. `observe` and `observe_batch` may be called from any thread
    (the engine's compute worker); `refit` from one thread at a time. The calibration's single
    calls are re-timed to the served ones before each fit (`retimed`: its shapes kept, its
    level the host's now), and the fits are robust, so served timings that disagree with the
    calibration decide: for the single-call terms (a robust regression) and for the batch term
    alike (a median of savings, where once served batches outnumber the calibration's, those
    are the outliers).
    """

    def __init__(
        self,
        calibration: Sequence[Sample],
        initial: CostModel,
        capacity: int = 512,
        refit_after: int = 8,
        batches: Sequence[BatchSample] = (),
    ) -> None:
        """`refit_after`: served samples (single or batched calls) that must arrive before
        `refit` fits again; `batches`: the calibration's timed batches (`measure_batches`);
        `initial`: the calibration's fit, against which served timings re-time the calibration
        (`retimed`)."""
        self._calibration = tuple(calibration)
        self._calibrated = initial
        self._calibration_batches = tuple(batches)
        self._served: deque[Sample] = deque(maxlen=capacity)
        self._served_batches: deque[ServedBatch] = deque(maxlen=capacity)
        self._unfitted = 0
        self._refit_after = refit_after
        self._lock = threading.Lock()
        self.model = initial

    def observe(self, sample: Sample) -> None:
        """A single call's timing (a request's prefill, extension, rank or full inference)."""
        if sample.ms <= 0:
            return
        with self._lock:
            self._served.append(sample)
            self._unfitted += 1

    def observe_batch(self, batch: ServedBatch) -> None:
        """A batched call's timing: what it taught is the batch term (no one request's time
        alone is in it, so it teaches the single-call terms nothing)."""
        if batch.ms <= 0 or len(batch.shapes) < 2:
            return
        with self._lock:
            self._served_batches.append(batch)
            self._unfitted += 1

    @property
    def served(self) -> int:
        """Served samples held now, single and batched calls."""
        with self._lock:
            return len(self._served) + len(self._served_batches)

    def refit(self) -> CostModel | None:
        """Fit again if `refit_after` samples arrived since the last fit: the new model (also
        now `model`), else None. Reload cost is the calibration's (nothing served times it).

        The batch term is fitted after the single-call terms, over the calibration's batches
        (their measured singles as baseline) and the served ones (the refitted model's singles
        as baseline: `ServedBatch.against`); with no batch timed at all, the current term
        stands."""
        with self._lock:
            if self._unfitted < self._refit_after:
                return None
            served = list(self._served)
            served_batches = list(self._served_batches)
            self._unfitted = 0
        samples = [*retimed(self._calibration, served, self._calibrated), *served]
        fitted = dataclasses.replace(
            fit_cost_model(samples, self.model.reload_ms_per_mb),
            batch_saving_ms=self.model.batch_saving_ms,
            batch_samples=self.model.batch_samples,
        )
        batches = [*self._calibration_batches, *(b.against(fitted) for b in served_batches)]
        self.model = fit_batch_saving(fitted, batches)
        return self.model


# Requests in the batch of each probe that `changed_materially` compares.
_PROBE_BATCH = 4


def changed_materially(
    old: CostModel, new: CostModel, probes: Sequence[tuple[int, int]], threshold: float
) -> bool:
    """Does `new` predict any probe (tokens, candidates) differently from `old` by more than
    `threshold` (relative: full inference, prefill, or a batch of cached Ranks of that
    prefix), or is its error off by more than that?"""
    for tokens, candidates in probes:
        batch = [CallShape(tokens, 0, candidates)] * _PROBE_BATCH
        pairs = (
            (old.full_ms(tokens, candidates), new.full_ms(tokens, candidates)),
            (old.prefill_ms(tokens), new.prefill_ms(tokens)),
            (batch_ms(old, batch), batch_ms(new, batch)),
        )
        for before, after in pairs:
            if abs(after - before) > threshold * max(before, 1e-9):
                return True
    return abs(new.median_abs_rel_error - old.median_abs_rel_error) > threshold


class Republisher:
    """Decides when a refitted model goes to the mesh membership: when it changed materially
    from the one published, and no sooner than `min_interval_s` after the last publication
    (each one is an etcd write that every router and trigger watches)."""

    def __init__(
        self,
        published: CostModel,
        now: float,
        probes: Sequence[tuple[int, int]],
        threshold: float = 0.1,
        min_interval_s: float = 30.0,
    ) -> None:
        self.published = published
        self._published_at = now
        self._probes = tuple(probes)
        self._threshold = threshold
        self._min_interval_s = min_interval_s

    def offer(self, model: CostModel, now: float) -> bool:
        """True: publish `model` now (it is then the published one)."""
        if now - self._published_at < self._min_interval_s:
            return False
        if not changed_materially(self.published, model, self._probes, self._threshold):
            return False
        self.published, self._published_at = model, now
        return True
