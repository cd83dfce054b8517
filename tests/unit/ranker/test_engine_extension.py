"""Extension only from a true prefix: a user's cached shorter prefix is extended when its
content starts the new history, and never when it does not (another first behaviour, other user
features, another history of the same user); every score equals the dense float64 reference.

The engine picks the base by the user's keys alone, so only the content check keeps a
diverging base from being extended: wrong scores, reported as EXTENDED.
"""

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from relaygr.behaviours import Behaviours, Prefix, RankInput
from services.ranker.engine import CacheOutcome, PreInferOutcome, RankerEngine, RankResult
from services.ranker.observer import Work
from tests.unit.ranker.dense_reference import DenseReference
from tests.unit.ranker.factories import behaviours, longer, prefix, rank_input, rel_err
from tests.unit.ranker.test_engine import (
    CANDIDATES,
    MODEL,
    SHORT,
    TOKENS,
    USER_FEATURES,
    running_engine,
)
from tests.unit.ranker.test_oracle import FP32_TOLERANCE

MORE = 40  # behaviours the new history has beyond the cached prefix's length
REFERENCE = DenseReference(MODEL)


def assert_dense_exact(result: RankResult, request: RankInput) -> None:
    """The engine's scores equal the independent dense float64 reference."""
    expected = REFERENCE.forward(request).scores
    err = rel_err(result.scores, expected)
    print(f"{result.outcome}: rel_err vs the dense reference {err:.2e}")
    assert result.scores.shape == expected.shape
    assert err <= FP32_TOLERANCE, err


def _first_behaviour_changed(rng: np.random.Generator, cached: Prefix) -> Prefix:
    """The same user features and behaviours but the first item: the same length."""
    items = cached.long_term.item_ids.copy()
    items[0] ^= 1 + int(rng.integers(0, 1 << 20))
    long_term = Behaviours(items, cached.long_term.actions, cached.long_term.timestamps)
    return Prefix(cached.user_id, cached.user_features, long_term)


def _other_user_features(rng: np.random.Generator, cached: Prefix) -> Prefix:
    features = cached.user_features.copy()
    features[-1] ^= 1 + int(rng.integers(0, 1 << 20))
    return Prefix(cached.user_id, features, cached.long_term)


def _other_history(rng: np.random.Generator, cached: Prefix) -> Prefix:
    """Another history of the same length (a reset, or another device's log)."""
    return Prefix(cached.user_id, cached.user_features, behaviours(rng, len(cached.long_term)))


DIVERGING: dict[str, Callable[[np.random.Generator, Prefix], Prefix]] = {
    "first-behaviour": _first_behaviour_changed,
    "user-features": _other_user_features,
    "other-history": _other_history,
}


def _cached_then_rank(engine: RankerEngine, cached: Prefix, request: RankInput) -> RankResult:
    async def scenario() -> RankResult:
        await engine.pre_infer(cached, None, None)
        return await engine.rank(request, None)

    return asyncio.run(scenario())


def test_a_true_prefix_is_extended_exactly(rng: np.random.Generator) -> None:
    cached = prefix(rng, TOKENS, user_id="u")
    request = rank_input(rng, longer(rng, cached, MORE))
    with running_engine() as (engine, observer):
        ranked = _cached_then_rank(engine, cached, request)
        assert (ranked.outcome, ranked.computed_tokens) == (
            CacheOutcome.EXTENDED,
            MORE + SHORT + CANDIDATES,
        )
        assert observer.landed[-1] == (Work.EXTEND, MORE)
    assert_dense_exact(ranked, request)


@pytest.mark.parametrize("diverge", list(DIVERGING))
def test_a_rank_never_extends_a_cached_prefix_that_does_not_start_its_history(
    rng: np.random.Generator, diverge: str
) -> None:
    cached = prefix(rng, TOKENS, user_id="u")
    request = rank_input(rng, longer(rng, DIVERGING[diverge](rng, cached), MORE))
    with running_engine() as (engine, observer):
        ranked = _cached_then_rank(engine, cached, request)
        assert_dense_exact(ranked, request)
        assert (ranked.outcome, ranked.computed_tokens) == (
            CacheOutcome.MISS,
            TOKENS + MORE + USER_FEATURES + SHORT + CANDIDATES,
        )
        # Computed from nothing, as its full inference (which keeps the new prefix).
        assert observer.landed == [(Work.PREFILL, TOKENS + USER_FEATURES)]
        assert observer.scored == [Work.FULL_FORWARD]


@pytest.mark.parametrize("diverge", list(DIVERGING))
def test_a_pre_infer_never_extends_a_cached_prefix_that_does_not_start_its_history(
    rng: np.random.Generator, diverge: str
) -> None:
    cached = prefix(rng, TOKENS, user_id="u")
    request = rank_input(rng, longer(rng, DIVERGING[diverge](rng, cached), MORE))
    with running_engine() as (engine, _):

        async def scenario() -> tuple[PreInferOutcome, RankResult]:
            await engine.pre_infer(cached, None, None)
            pre = await engine.pre_infer(request.prefix, None, None)
            return pre.outcome, await engine.rank(request, None)

        outcome, ranked = asyncio.run(scenario())
        assert outcome is PreInferOutcome.COMPUTED
        assert ranked.outcome is CacheOutcome.HBM_HIT  # the PreInfer's own prefix
    assert_dense_exact(ranked, request)
