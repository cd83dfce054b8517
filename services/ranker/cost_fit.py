"""Robust, non-negative fit of a ranker's cost model to timed runs, and the fit's error."""

import dataclasses
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from relaygr.cost import CallShape, CostModel

# Tukey's bisquare tuning constant (95% efficiency on Gaussian noise) and Huber's, for the
# first iterations: Huber converges from a least-squares start that outliers may have pulled
# far; the bisquare then gives gross outliers no weight at all.
_TUKEY = 4.685
_HUBER = 1.345
_HUBER_ITERATIONS = 4
_ITERATIONS = 30
# Relative residuals below this are noise, whatever the data's own spread: a scale floor keeps
# near-exact data (every residual ~0) from making every sample an outlier.
_MIN_SCALE = 0.02


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed run of `ms`: `tokens` history tokens and `candidates` scored.

    `cached_tokens` None: the run started from nothing (a prefill or full inference), so it
    paid the fixed cost; an int: it extended, or scored on, a cached prefix of that many tokens
    and computed only the rest, with no fixed cost of its own (the model's full inference is
    prefill + rank, so a rank's overheads are carried by its per-token terms).
    """

    tokens: int
    candidates: int
    ms: float
    cached_tokens: int | None = None

    def features(self) -> tuple[float, float, float, float]:
        """The coefficients' multipliers: (fixed, per_token, per_pair, per_candidate_key)."""
        cached = self.cached_tokens or 0
        return (
            1.0 if self.cached_tokens is None else 0.0,
            float(self.tokens - cached + self.candidates),
            (self.tokens**2 - cached**2) / 2,
            float(self.candidates * self.tokens),
        )

    @property
    def is_cached_rank(self) -> bool:
        """Did it score candidates on a cached prefix (fitted by the cached-rank terms)?"""
        return bool(self.cached_tokens) and self.candidates > 0

    def cached_features(self) -> tuple[float, float, float, float]:
        """A cached rank's multipliers: (cached_fixed, per_row, per_key, per_row_key)."""
        rows = float(self.tokens - (self.cached_tokens or 0) + self.candidates)
        return (1.0, rows, float(self.tokens), rows * self.tokens)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares over few columns, exactly: the optimum is the least-squares
    solution on its own support, so the best non-negative solution over every support is it."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    scaled = a / norms  # columns span ~10 orders of magnitude (1 against t^2)
    best, best_residual = np.zeros(a.shape[1]), float(np.linalg.norm(b))
    for mask in itertools.product((True, False), repeat=a.shape[1]):
        active = np.array(mask)
        if not active.any():
            continue
        solution, *_ = np.linalg.lstsq(scaled[:, active], b, rcond=None)
        if (solution < 0).any():
            continue
        coef = np.zeros(a.shape[1])
        coef[active] = solution
        residual = float(np.linalg.norm(scaled @ coef - b))
        if residual < best_residual:
            best, best_residual = coef, residual
    return best / norms


def _weights(residuals: np.ndarray, tukey: bool) -> np.ndarray:
    scale = max(1.4826 * float(np.median(np.abs(residuals))), _MIN_SCALE)
    u = np.abs(residuals) / scale
    if tukey:
        return np.where(u < _TUKEY, (1 - (u / _TUKEY) ** 2) ** 2, 0.0)
    return np.where(u <= _HUBER, 1.0, _HUBER / np.maximum(u, 1e-12))


def _main_terms(model: CostModel) -> np.ndarray:
    return np.array(
        [model.fixed_ms, model.per_token_ms, model.per_pair_ms, model.per_candidate_key_ms]
    )


def _cached_terms(model: CostModel) -> np.ndarray:
    return np.array(list(model.cached_terms().values()))


def predicted_ms(model: CostModel, sample: Sample) -> float:
    """What `model` predicts for the timed run `sample`: a cached rank by the cached-rank
    terms when they are fitted, anything else (and then a cached rank too) by the others."""
    if sample.is_cached_rank and model.prices_cached_ranks:
        return float(np.dot(sample.cached_features(), _cached_terms(model)))
    return float(np.dot(sample.features(), _main_terms(model)))


def relative_errors(model: CostModel, samples: Sequence[Sample]) -> np.ndarray:
    """|predicted - measured| / measured of each sample under `model`."""
    return np.array([abs(predicted_ms(model, s) - s.ms) / s.ms for s in samples])


def _robust_fit(rows: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Non-negative coefficients for `rows` (one per timed run) against `measured`, resisting
    outliers: minimises relative, not absolute, error (a 100 ms run and a 4 s run count alike:
    the model must hold across the length range) by iteratively reweighted non-negative least
    squares, Huber weights, then Tukey's bisquare, on residuals scaled by their median
    absolute value."""
    width = rows.shape[1]
    relative = rows / measured[:, None]  # each row scaled to its measurement: relative error
    ones = np.ones(len(measured))
    weights = ones
    coef = np.zeros(width)
    for i in range(_ITERATIONS):
        root = np.sqrt(weights)
        new = _nnls(relative * root[:, None], ones * root)
        residuals = relative @ new - ones
        weights = _weights(residuals, tukey=i >= _HUBER_ITERATIONS)
        if weights.sum() < width:  # too few inliers to fit every coefficient: keep them all
            weights = ones
        done = i > _HUBER_ITERATIONS and np.allclose(new, coef, rtol=1e-6, atol=1e-12)
        coef = new
        if done:
            break
    return coef


# Timed cached ranks needed to fit their four terms (calibration's two Ranks at each of three
# lengths); fewer: they stay unfitted (0).
_MIN_CACHED_RANKS = 6


def fit_cost_model(samples: Sequence[Sample], reload_ms_per_mb: float) -> CostModel:
    """Fit the model's non-negative coefficients to `samples` (`_robust_fit`): the
    full-inference terms to the runs that started from nothing or extended a prefix, the
    cached-rank terms to the runs that scored candidates on a cached prefix, when there are
    at least `_MIN_CACHED_RANKS` of those. The model carries the median relative error over
    all samples and their count.
    """
    usable = [s for s in samples if s.ms > 0]
    main = [s for s in usable if not s.is_cached_rank]
    if not main:
        raise ValueError("no timed prefill or full inference to fit a cost model to")
    fixed, per_token, per_pair, per_candidate_key = (
        float(c)
        for c in _robust_fit(np.array([s.features() for s in main]), np.array([s.ms for s in main]))
    )
    ranks = [s for s in usable if s.is_cached_rank]
    cached: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
    if len(ranks) >= _MIN_CACHED_RANKS:
        rows = np.array([s.cached_features() for s in ranks])
        cached = tuple(float(c) for c in _robust_fit(rows, np.array([s.ms for s in ranks])))
    fitted = CostModel(
        fixed, per_token, per_pair, per_candidate_key, reload_ms_per_mb,
        cached_fixed_ms=cached[0], cached_per_row_ms=cached[1], cached_per_key_ms=cached[2],
        cached_per_row_key_ms=cached[3],
    )  # fmt: skip
    error = float(np.median(relative_errors(fitted, usable)))
    return dataclasses.replace(fitted, median_abs_rel_error=error, samples=len(usable))


@dataclass(frozen=True, slots=True)
class BatchSample:
    """One timed batch: the requests' `shapes`, the batch's time as one model call, and the
    same requests' time as single calls run back to back with it (so load drift hits both)."""

    shapes: tuple[CallShape, ...]
    batch_ms: float
    singles_ms: float

    def saving_ms(self) -> float:
        """What each request after the first saved by sharing the call."""
        return (self.singles_ms - self.batch_ms) / (len(self.shapes) - 1)


@dataclass(frozen=True, slots=True)
class ServedBatch:
    """One batched call as the ranker served it: its requests' `shapes` and the call's `ms`.
    No single calls ran beside it, so its saving is judged against a model of them
    (`against`)."""

    shapes: tuple[CallShape, ...]
    ms: float

    def against(self, cost: CostModel) -> BatchSample:
        """This batch as a timed one whose singles took what `cost` predicts for them: the
        saving fitted from it is then what makes `batch_ms(cost, shapes)` predict the call."""
        return BatchSample(self.shapes, self.ms, sum(cost.shape_ms(s) for s in self.shapes))


def fit_batch_saving(cost: CostModel, samples: Sequence[BatchSample]) -> CostModel:
    """`cost` with `batch_saving_ms` fitted to timed batches of two or more requests.

    The saving is the median over samples of each batch's own saving per extra request, so a
    batch (or its singles) slowed by load elsewhere on the host moves it little; it is never
    negative (a batch that measured slower than its singles is noise, or no saving: batch_ms
    then predicts the singles' time). A calibration batch's baseline is its measured singles,
    so the single model's own error does not leak into the batch term; a served batch has none
    and brings the model's (`ServedBatch.against`). Without usable samples, `cost` is returned
    unchanged.
    """
    usable = [s for s in samples if len(s.shapes) > 1 and s.batch_ms > 0 and s.singles_ms > 0]
    if not usable:
        return cost
    saving = max(0.0, statistics.median(s.saving_ms() for s in usable))
    return dataclasses.replace(cost, batch_saving_ms=saving, batch_samples=len(usable))
