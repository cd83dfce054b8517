"""Oracle tests: every cached path equals full inference (docs/architecture.md §2: exactness)."""

import itertools

import numpy as np
import pytest
import torch

from relaygr.behaviours import Prefix, RankInput
from services.ranker.model import RankingModel
from services.ranker.model_config import ModelConfig

from .factories import T0, behaviours, model_device, prefix, rank_input, rel_err, tiny_config

FP32_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model() -> RankingModel:
    return RankingModel(tiny_config(), seed=3, device=model_device())


@pytest.mark.parametrize("n_long", [0, 1, 2, 63, 64, 65, 300, 2048, 3000])
def test_rank_on_prefill_equals_full_forward(
    model: RankingModel, rng: np.random.Generator, n_long: int
) -> None:
    n_user = int(rng.integers(0, 9))
    n_short = int(rng.integers(0, 100))
    request = rank_input(rng, prefix(rng, n_long, n_user), n_short, int(rng.integers(1, 65)))
    full = model.full_forward(request)
    kv = model.prefill(request.prefix)
    cached = model.rank(kv, request.short_term, request.candidates, request.request_ts)
    assert kv.num_tokens == n_user + n_long
    assert cached.shape == full.shape == (2, len(request.candidates))
    assert rel_err(cached, full) <= FP32_TOLERANCE


def test_default_model_is_exact_at_long_prefix(rng: np.random.Generator) -> None:
    """The shipped default configuration, at a prefix over 2,048 tokens."""
    model = RankingModel(ModelConfig(), seed=int(rng.integers(0, 2**31)), device=model_device())
    request = rank_input(rng, prefix(rng, 2100, 8), n_short=128, n_candidates=64)
    full = model.full_forward(request)
    cached = model.rank(
        model.prefill(request.prefix), request.short_term, request.candidates, request.request_ts
    )
    assert rel_err(cached, full) <= FP32_TOLERANCE
    # The scores use the probability range, so the tolerance above is not met by accident.
    assert float(full.std()) > 0.05


@pytest.mark.parametrize("chunks", [2, 3, 7])
def test_extend_in_chunks_equals_one_prefill(
    model: RankingModel, rng: np.random.Generator, chunks: int
) -> None:
    whole = prefix(rng, int(rng.integers(200, 700)))
    cuts = np.sort(rng.choice(np.arange(1, len(whole.long_term)), chunks - 1, replace=False))
    bounds = [0, *cuts.tolist(), len(whole.long_term)]
    kv = model.prefill(
        Prefix(whole.user_id, whole.user_features, whole.long_term.slice(0, bounds[1]))
    )
    for start, stop in itertools.pairwise(bounds[1:]):
        kv = model.extend(kv, whole.long_term.slice(start, stop))
    one_shot = model.prefill(whole)
    assert kv.digest == one_shot.digest
    assert kv.num_tokens == one_shot.num_tokens
    assert rel_err(kv.keys, one_shot.keys) <= FP32_TOLERANCE
    assert rel_err(kv.values, one_shot.values) <= FP32_TOLERANCE
    assert torch.equal(kv.timestamps, one_shot.timestamps)
    request = rank_input(rng, whole)
    assert (
        rel_err(
            model.rank(kv, request.short_term, request.candidates, request.request_ts),
            model.full_forward(request),
        )
        <= FP32_TOLERANCE
    )


def test_extend_from_empty_prefix(model: RankingModel, rng: np.random.Generator) -> None:
    whole = prefix(rng, 150, n_user=0)
    empty = model.prefill(Prefix(whole.user_id, whole.user_features, whole.long_term.slice(0, 0)))
    assert empty.num_tokens == 0
    extended = model.extend(empty, whole.long_term)
    assert rel_err(extended.keys, model.prefill(whole).keys) <= FP32_TOLERANCE


def test_candidate_score_ignores_the_other_candidates(
    model: RankingModel, rng: np.random.Generator
) -> None:
    request = rank_input(rng, prefix(rng, 400), n_candidates=40)
    base = model.full_forward(request)
    ids = request.candidates
    order = rng.permutation(len(ids))
    subset = order[: len(ids) // 3]
    extra = rng.integers(0, 1 << 50, 20)
    variants = {
        "reordered": (ids[order], order),
        "subset": (ids[subset], subset),
        "superset": (np.concatenate([extra, ids]), np.arange(len(ids)) + len(extra)),
    }
    kv = model.prefill(request.prefix)
    for name, (candidates, positions) in variants.items():
        changed = RankInput(request.prefix, request.short_term, candidates, request.request_ts)
        full = model.full_forward(changed)
        cached = model.rank(kv, request.short_term, candidates, request.request_ts)
        columns = np.arange(len(positions)) if name != "superset" else positions
        expected = base[:, positions] if name != "superset" else base
        assert rel_err(full[:, columns], expected) <= FP32_TOLERANCE, name
        assert rel_err(cached[:, columns], expected) <= FP32_TOLERANCE, name


def test_scores_depend_on_the_history(model: RankingModel, rng: np.random.Generator) -> None:
    """Guards the oracle: if history were ignored, every equality above would hold trivially."""
    request = rank_input(rng, prefix(rng, 100))
    other = rank_input(rng, prefix(rng, 100))
    moved = RankInput(other.prefix, other.short_term, request.candidates, request.request_ts)
    assert rel_err(model.full_forward(moved), model.full_forward(request)) > 1e-3


def test_candidate_time_matters(model: RankingModel, rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, 50))
    later = RankInput(
        request.prefix, request.short_term, request.candidates, request.request_ts + 10**6
    )
    assert rel_err(model.full_forward(later), model.full_forward(request)) > 1e-4


def test_unsorted_and_equal_timestamps_stay_exact(
    model: RankingModel, rng: np.random.Generator
) -> None:
    p = prefix(rng, 120)
    shuffled = behaviours(rng, 120)
    shuffled.timestamps[:] = rng.permutation(shuffled.timestamps)
    shuffled.timestamps[:10] = T0
    request = rank_input(rng, Prefix(p.user_id, p.user_features, shuffled))
    cached = model.rank(
        model.prefill(request.prefix), request.short_term, request.candidates, request.request_ts
    )
    assert rel_err(cached, model.full_forward(request)) <= FP32_TOLERANCE
