"""Small factories for ranking-model tests: a tiny config and random requests."""

from dataclasses import replace

import numpy as np

from relaygr.behaviours import Behaviours, Prefix, RankInput
from services.ranker.model_config import PRESETS, ModelConfig, ModelPreset
from services.ranker.synthetic import random_behaviours

T0 = 1_700_000_000


def tiny_config(**overrides: object) -> ModelConfig:
    """The tiny preset (fast, with blocks small enough to span several), with `overrides`."""
    return replace(PRESETS[ModelPreset.TINY], **overrides)  # type: ignore[arg-type]


def behaviours(rng: np.random.Generator, n: int, start: int = T0, span: int = 10**7) -> Behaviours:
    return random_behaviours(rng, n, start, span)


def prefix(rng: np.random.Generator, n_long: int, n_user: int = 4, user_id: str = "u") -> Prefix:
    return Prefix(user_id, rng.integers(0, 1 << 40, n_user), behaviours(rng, n_long))


def rank_input(
    rng: np.random.Generator, p: Prefix, n_short: int = 16, n_candidates: int = 32
) -> RankInput:
    start = T0 + 10**7
    return RankInput(
        p,
        behaviours(rng, n_short, start=start, span=10**5),
        rng.integers(0, 1 << 50, n_candidates),
        start + 10**5 + int(rng.integers(0, 1000)),
    )


def rel_err(actual: object, expected: object) -> float:
    """max|a - b| / max|b|: relative to the scale of the scores, not to each (possibly tiny) one."""
    import torch

    a, b = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
