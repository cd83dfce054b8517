"""A cost model that keeps learning from the work a ranker serves, and when to republish it."""

import dataclasses
import threading
from collections import deque
from collections.abc import Sequence

from relaygr.cost import CostModel
from services.ranker.cost_fit import Sample, fit_cost_model


class CostLearner:
    """The calibrated model, refitted over its calibration and the most recent served timings.

    Invariants: the calibration's samples are kept for good; of the served samples, at most
    `capacity`, the most recent (older ones leave first), so the model follows the host as its
    load changes while each refit stays a bounded fit. `observe` may be called from any thread
    (the engine's compute worker); `refit` from one thread at a time. The fit is robust, so once
    served timings outnumber the calibration's and disagree with it, the calibration's points
    count as outliers and the served ones decide.
    """

    def __init__(
        self,
        calibration: Sequence[Sample],
        initial: CostModel,
        capacity: int = 512,
        refit_after: int = 8,
    ) -> None:
        """`refit_after`: served samples that must arrive before `refit` fits again."""
        self._calibration = tuple(calibration)
        self._served: deque[Sample] = deque(maxlen=capacity)
        self._unfitted = 0
        self._refit_after = refit_after
        self._lock = threading.Lock()
        self.model = initial

    def observe(self, sample: Sample) -> None:
        if sample.ms <= 0:
            return
        with self._lock:
            self._served.append(sample)
            self._unfitted += 1

    @property
    def served(self) -> int:
        """Served samples held now."""
        with self._lock:
            return len(self._served)

    def refit(self) -> CostModel | None:
        """Fit again if `refit_after` samples arrived since the last fit: the new model (also
        now `model`), else None. Reload cost and the batch term are the calibration's (nothing
        served times them: a served batch has no single calls beside it to compare with)."""
        with self._lock:
            if self._unfitted < self._refit_after:
                return None
            samples = [*self._calibration, *self._served]
            self._unfitted = 0
        fitted = fit_cost_model(samples, self.model.reload_ms_per_mb)
        self.model = dataclasses.replace(
            fitted,
            batch_saving_ms=self.model.batch_saving_ms,
            batch_samples=self.model.batch_samples,
        )
        return self.model


def changed_materially(
    old: CostModel, new: CostModel, probes: Sequence[tuple[int, int]], threshold: float
) -> bool:
    """Does `new` predict any probe (tokens, candidates) differently from `old` by more than
    `threshold` (relative, full inference or prefill), or is its error off by more than that?"""
    for tokens, candidates in probes:
        pairs = (
            (old.full_ms(tokens, candidates), new.full_ms(tokens, candidates)),
            (old.prefill_ms(tokens), new.prefill_ms(tokens)),
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
