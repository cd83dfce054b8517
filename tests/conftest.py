"""Shared test fixtures: a printed random seed per run, reproducible with RELAYGR_SEED; `async
def` tests run on a fresh event loop each (tests/asyncio_plugin.py)."""

import os
import random

import numpy as np
import pytest

pytest_plugins = ("tests.asyncio_plugin",)

_SEED = int(os.environ.get("RELAYGR_SEED", random.SystemRandom().randrange(2**32)))


def pytest_report_header() -> str:
    return f"random inputs seed: RELAYGR_SEED={_SEED}"


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the run seed and the test's name; the seed is printed."""
    seed = (_SEED + sum(map(ord, request.node.nodeid)) * 7919) % 2**32
    print(f"seed={seed} (run seed RELAYGR_SEED={_SEED})")
    return np.random.default_rng(seed)
