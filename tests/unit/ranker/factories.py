"""Small factories for ranking-model tests: a tiny config, the device models run on, random
requests."""

import os
from dataclasses import replace

import numpy as np

from relaygr.behaviours import Behaviours, Prefix, RankInput
from services.ranker.model_config import PRESETS, ModelConfig, ModelPreset
from services.ranker.synthetic import random_behaviours

T0 = 1_700_000_000
LONG_TERM_END = T0 + 10**7  # long-term behaviours happen in [T0, LONG_TERM_END), short-term after


def model_device() -> str:
    """Where the model tests build their models: `RELAYGR_TEST_DEVICE` (`cpu` unless set), so the
    exactness tests run unchanged on an accelerator (`RELAYGR_TEST_DEVICE=cuda`, README)."""
    return os.environ.get("RELAYGR_TEST_DEVICE", "cpu")


def tiny_config(**overrides: object) -> ModelConfig:
    """The tiny preset (fast, with blocks small enough to span several), with `overrides`."""
    return replace(PRESETS[ModelPreset.TINY], **overrides)  # type: ignore[arg-type]


def behaviours(
    rng: np.random.Generator, n: int, start: int = T0, span: int = LONG_TERM_END - T0
) -> Behaviours:
    return random_behaviours(rng, n, start, span)


def prefix(rng: np.random.Generator, n_long: int, n_user: int = 4, user_id: str = "u") -> Prefix:
    return Prefix(user_id, rng.integers(0, 1 << 40, n_user), behaviours(rng, n_long))


def longer(rng: np.random.Generator, p: Prefix, more: int) -> Prefix:
    """The user's prefix after `more` later behaviours: `p` is a strict prefix of it, and its
    timestamps stay non-decreasing."""
    last = int(p.long_term.timestamps[-1]) if len(p.long_term) else T0
    later = behaviours(rng, more, last, LONG_TERM_END - last)
    return Prefix(p.user_id, p.user_features, p.long_term.concat(later))


def rank_input(
    rng: np.random.Generator, p: Prefix, n_short: int = 16, n_candidates: int = 32
) -> RankInput:
    start = LONG_TERM_END
    return RankInput(
        p,
        behaviours(rng, n_short, start=start, span=10**5),
        rng.integers(0, 1 << 50, n_candidates),
        start + 10**5 + int(rng.integers(0, 1000)),
    )


def rel_err(actual: object, expected: object) -> float:
    """max|a - b| / max|b|: relative to the scale of the scores, not to each (possibly tiny) one."""
    import torch

    a = torch.as_tensor(actual).to("cpu", torch.float64)
    b = torch.as_tensor(expected).to("cpu", torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
