"""Calibration of a ranker's latency model (`relaygr.cost.CostModel`) at start-up."""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from relaygr.behaviours import Behaviours, Prefix, RankInput, UserId
from relaygr.cost import CostModel
from services.ranker.model import RankingModel
from services.ranker.synthetic import random_behaviours


@dataclass(frozen=True, slots=True)
class Sample:
    tokens: int
    candidates: int
    ms: float


def fit_cost_model(samples: Sequence[Sample], reload_ms_per_mb: float) -> CostModel:
    """Least-squares fit of the four non-negative coefficients to measured runs.

    Prefill samples have candidates == 0. Coefficients that come out negative (noise on a
    term the lengths barely exercise) are clamped to zero and the rest refitted.
    """
    rows = np.array(
        [[1.0, s.tokens + s.candidates, s.tokens**2 / 2, s.candidates * s.tokens] for s in samples]
    )
    target = np.array([s.ms for s in samples])
    active = np.ones(4, dtype=bool)
    coef = np.zeros(4)
    for _ in range(4):
        solution, *_ = np.linalg.lstsq(rows[:, active], target, rcond=None)
        coef[:] = 0.0
        coef[active] = solution
        if (coef >= 0).all():
            break
        active &= coef > 0
    fixed, per_token, per_pair, per_candidate_key = (float(c) for c in np.clip(coef, 0.0, None))
    return CostModel(fixed, per_token, per_pair, per_candidate_key, reload_ms_per_mb)


def calibrate(
    model: RankingModel,
    lengths: Sequence[int],
    candidates: int,
    timer: Callable[[], float] = time.perf_counter,
    repeats: int = 2,
) -> CostModel:
    """Time full inference and prefill on this device at `lengths` and fit the cost model."""
    rng = np.random.default_rng(0)
    samples: list[Sample] = []

    def timed(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = timer()
            fn()
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            best = min(best, (timer() - start) * 1e3)
        return best

    for length in lengths:
        behaviours = random_behaviours(
            rng, length, 1_700_000_000, 60 * length, model.cfg.num_actions
        )
        prefix = Prefix(UserId("calibration"), np.zeros(0, np.int64), behaviours)
        items = rng.integers(0, 1 << 40, candidates)
        request = RankInput(prefix, Behaviours.empty(), items, 1_800_000_000)
        model.prefill(prefix)  # warm-up at this size
        samples.append(Sample(length, 0, timed(partial(model.prefill, prefix))))
        samples.append(Sample(length, candidates, timed(partial(model.full_forward, request))))
    return fit_cost_model(samples, reload_ms_per_mb=_reload_ms_per_mb(model.device, timer))


def _reload_ms_per_mb(device: torch.device, timer: Callable[[], float]) -> float:
    """Host-to-device copy time per MiB (a host memcpy when the device is the CPU)."""
    host = torch.empty(16 * 2**20, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    best = float("inf")
    for _ in range(3):
        start = timer()
        host.to(device, copy=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (timer() - start) * 1e3)
    return best / 16
