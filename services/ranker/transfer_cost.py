"""The peer-transfer cost model, refitted from the fetches a ranker makes: fixed + per-MiB."""

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from relaygr.cost import TransferCost

# As in cost_fit: relative residuals below this are noise, and Tukey's bisquare constant.
_MIN_SCALE = 0.02
_TUKEY = 4.685
_ITERATIONS = 20
_MIB = 2**20


@dataclass(frozen=True, slots=True)
class TransferSample:
    """One fetch that landed: `nbytes` of payload in `ms`, request to device-resident entry."""

    nbytes: int
    ms: float


def fit_transfer_cost(samples: list[TransferSample]) -> TransferCost:
    """Fit fixed + per-MiB, both non-negative, to `samples`, minimising relative error and
    resisting outliers (a fetch that queued behind a burst): iteratively reweighted least
    squares with Tukey's bisquare on residuals scaled by their median absolute value."""
    usable = [s for s in samples if s.ms > 0]
    if not usable:
        raise ValueError("no timed fetches to fit a transfer cost to")
    measured = np.array([s.ms for s in usable])
    rows = np.array([[1.0, s.nbytes / _MIB] for s in usable]) / measured[:, None]
    ones = np.ones(len(usable))
    weights = ones
    coef = np.zeros(2)
    for _ in range(_ITERATIONS):
        coef = _nonnegative_fit(rows * np.sqrt(weights)[:, None], np.sqrt(weights))
        residuals = rows @ coef - ones
        scale = max(1.4826 * float(np.median(np.abs(residuals))), _MIN_SCALE)
        u = np.abs(residuals) / scale
        weights = np.where(u < _TUKEY, (1 - (u / _TUKEY) ** 2) ** 2, 0.0)
        if weights.sum() < 2:  # too few inliers for two coefficients: keep them all
            weights = ones
    error = float(np.median(np.abs(rows @ coef - ones)))
    return TransferCost(float(coef[0]), float(coef[1]), error, len(usable))


def _nonnegative_fit(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares over two non-negative coefficients: the unconstrained optimum if it is
    non-negative, else the better of the two one-coefficient fits."""
    solution, *_ = np.linalg.lstsq(a, b, rcond=None)
    if (solution >= 0).all():
        return np.asarray(solution)
    best, best_residual = np.zeros(2), float(np.linalg.norm(b))
    for column in (0, 1):
        norm = float(a[:, column] @ a[:, column])
        if norm == 0:
            continue
        coef = np.zeros(2)
        coef[column] = max(float(a[:, column] @ b) / norm, 0.0)
        residual = float(np.linalg.norm(a @ coef - b))
        if residual < best_residual:
            best, best_residual = coef, residual
    return best


class TransferLearner:
    """The configured prior, then a fit over the most recent fetches.

    Invariants: at most `capacity` samples, the most recent; `model` changes only by `observe`,
    every `refit_after` samples once `min_samples` are held (fewer say too little about the
    fixed cost against the per-MiB one, so the prior stays). Thread-safe.
    """

    def __init__(
        self,
        prior: TransferCost,
        capacity: int = 128,
        refit_after: int = 4,
        min_samples: int = 8,
    ) -> None:
        self.model = prior
        self._samples: deque[TransferSample] = deque(maxlen=capacity)
        self._unfitted = 0
        self._refit_after = refit_after
        self._min_samples = min_samples
        self._lock = threading.Lock()

    def observe(self, sample: TransferSample) -> TransferCost:
        """Keep `sample`; the model in use after it (refitted when due)."""
        if sample.ms <= 0:
            return self.model
        with self._lock:
            self._samples.append(sample)
            self._unfitted += 1
            if self._unfitted < self._refit_after or len(self._samples) < self._min_samples:
                return self.model
            self._unfitted = 0
            self.model = fit_transfer_cost(list(self._samples))
            return self.model
