"""Random behaviour sequences for demos, calibration, benchmarks and tests, seeded by callers."""

import numpy as np

from relaygr.behaviours import Behaviours

ITEM_ID_BITS = 50
DEFAULT_ACTIONS = 16


def random_behaviours(
    rng: np.random.Generator, n: int, start: int, span: int, num_actions: int = DEFAULT_ACTIONS
) -> Behaviours:
    """`n` behaviours: random items, actions in [1, num_actions), sorted times in [start, +span)."""
    return Behaviours.of(
        rng.integers(0, 1 << ITEM_ID_BITS, n),
        rng.integers(1, num_actions, n),
        np.sort(rng.integers(start, start + span, n)),
    )
