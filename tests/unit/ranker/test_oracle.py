"""Oracle tests: full and cached inference both equal an independent dense float64 reference.

test_model_exactness.py compares the model's cached path with its full path, but both share the
attention, bias and scoring code, so a bug in that shared maths passes it. Here both paths are
held to dense_reference.py, and two such bugs are injected to show that this oracle sees what the
self-comparison cannot.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import services.ranker.model as model_module
from relaygr.behaviours import RankInput
from services.ranker.hstu import HSTULayer
from services.ranker.model import RankingModel
from services.ranker.relative_bias import RelativeBias

from .dense_reference import DenseReference, ReferenceOutput
from .factories import model_device, prefix, rank_input, rel_err, tiny_config

# docs/architecture.md §2: fp32 relative error <= 1e-5. rel_err is max|a - b| / max|b| over all
# tasks and candidates, so with sigmoid scores (max near 1) this is about 1e-5 absolute per score.
# The model computes in float32 and the reference in float64; the gap measured is ~1e-7 to 1e-6.
FP32_TOLERANCE = 1e-5
# A mutation counts as caught only when the oracle's error is far above the tolerance.
CAUGHT = 100 * FP32_TOLERANCE

# (user features, long-term, short-term) behaviours: empty history (candidates see only
# themselves), one token, a few, one crossing tiny_config's 64-row attention block, and a few
# hundred tokens over several blocks with the prefix/short-term cut inside one.
LENGTHS = [(0, 0, 0), (1, 0, 0), (3, 5, 2), (4, 63, 9), (8, 300, 40)]


def _model_and_request(
    rng: np.random.Generator, n_user: int, n_long: int, n_short: int
) -> tuple[RankingModel, RankInput]:
    """A tiny model with weights drawn from `rng` and a random request of the given lengths."""
    model = RankingModel(tiny_config(), seed=int(rng.integers(0, 2**31)), device=model_device())
    request = rank_input(rng, prefix(rng, n_long, n_user), n_short, int(rng.integers(8, 33)))
    return model, request


@dataclass(frozen=True, slots=True)
class Traced:
    """Scores of one path and, per layer, the attention output rows it computed [R, H * d_v]."""

    scores: torch.Tensor
    attention: list[torch.Tensor]


class AttentionSpy:
    """Records the count-normalised attention every HSTULayer.finish receives, then forwards.

    It observes and changes nothing. Rows arrive in token order on every path: history query
    blocks (prefill, then rank's short-term), then the candidates; the last layer never finishes
    history rows (their outputs feed nothing), so it records candidate rows only.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, model: RankingModel) -> None:
        self.model = model
        self._index = {id(layer): i for i, layer in enumerate(model.layers)}
        self._calls: list[list[torch.Tensor]] = [[] for _ in model.layers]
        original = HSTULayer.finish

        def finish(
            layer: HSTULayer, x: torch.Tensor, u: torch.Tensor, attention: torch.Tensor
        ) -> torch.Tensor:
            self._calls[self._index[id(layer)]].append(attention.clone())
            return original(layer, x, u, attention)

        monkeypatch.setattr(HSTULayer, "finish", finish)

    def trace(self, scores: Callable[[], torch.Tensor]) -> Traced:
        for calls in self._calls:
            calls.clear()
        result = scores()
        rows = [
            torch.cat(calls, dim=1).transpose(0, 1).flatten(1)  # [H, R, dv] -> [R, H * dv]
            for calls in self._calls
        ]
        return Traced(result, rows)

    def full_and_cached(self, request: RankInput) -> tuple[Traced, Traced]:
        model = self.model
        full = self.trace(lambda: model.full_forward(request))
        cached = self.trace(
            lambda: model.rank(
                model.prefill(request.prefix),
                request.short_term,
                request.candidates,
                request.request_ts,
            )
        )
        return full, cached


def _errors(traced: Traced, expected: ReferenceOutput) -> tuple[float, float]:
    """rel_err of the scores, and the largest rel_err of any layer's attention rows."""
    last = len(traced.attention) - 1
    attention = max(
        rel_err(rows, expected.attention[i][expected.n_history if i == last else 0 :])
        for i, rows in enumerate(traced.attention)
    )
    return rel_err(traced.scores, expected.scores), attention


@pytest.mark.parametrize(("n_user", "n_long", "n_short"), LENGTHS)
def test_full_and_cached_equal_the_dense_reference(
    monkeypatch: pytest.MonkeyPatch,
    rng: np.random.Generator,
    n_user: int,
    n_long: int,
    n_short: int,
) -> None:
    model, request = _model_and_request(rng, n_user, n_long, n_short)
    expected = DenseReference(model).forward(request)
    full, cached = AttentionSpy(monkeypatch, model).full_and_cached(request)
    for path, traced in (("full", full), ("cached", cached)):
        score_err, attention_err = _errors(traced, expected)
        print(
            f"history={request.history_tokens} {path}: rel_err scores {score_err:.2e}, "
            f"attention {attention_err:.2e}"
        )
        assert traced.scores.shape == expected.scores.shape == (2, len(request.candidates))
        assert score_err <= FP32_TOLERANCE
        assert attention_err <= FP32_TOLERANCE
    # The scores spread over the probability range, so the tolerance is not met by accident.
    assert float(expected.scores.max() - expected.scores.min()) > 0.05


# -- mutations: each injects a bug into the code both model paths share ------------------------


def _measure_mutant(
    monkeypatch: pytest.MonkeyPatch, model: RankingModel, request: RankInput
) -> tuple[float, float]:
    """(scores, attention) errors of the mutated full path against the oracle, after checking
    that the mutant's cached and full paths still agree: the self-comparison passes it."""
    expected = DenseReference(model).forward(request)  # reads weights only: not mutated
    full, cached = AttentionSpy(monkeypatch, model).full_and_cached(request)
    self_err = rel_err(cached.scores, full.scores)
    score_err, attention_err = _errors(full, expected)
    print(
        f"history={request.history_tokens}: cached vs full {self_err:.2e}; oracle: scores "
        f"{score_err:.2e}, attention {attention_err:.2e}"
    )
    assert self_err <= FP32_TOLERANCE
    return score_err, attention_err


@pytest.mark.parametrize("n_long", [20, 300])
def test_oracle_catches_a_count_normalisation_off_by_one(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator, n_long: int
) -> None:
    """Rows divided by count + 1: consistent across paths, so cached still equals full.

    Dividing a row by a constant is nearly undone by the LayerNorm its attention output goes
    through next (only the norm's epsilon sees the scale), so the scores move by only ~1e-5 to
    1e-3 relative, at times under the tolerance (7.6e-6 measured at 320 tokens): a scores-only
    oracle would miss it. The attention outputs show it plainly, so that is what is asserted.
    """
    model, request = _model_and_request(rng, 4, n_long, 16)
    correct = model_module.key_counts

    def one_too_many(first_row: int, stop_row: int, like: torch.Tensor) -> torch.Tensor:
        return correct(first_row, stop_row, like) + 1

    monkeypatch.setattr(model_module, "key_counts", one_too_many)
    _, attention_err = _measure_mutant(monkeypatch, model, request)
    assert attention_err > CAUGHT


@pytest.mark.parametrize("n_long", [20, 300])
def test_oracle_catches_a_candidate_not_attending_to_itself(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator, n_long: int
) -> None:
    """The candidate's self term dropped: both paths score candidates in the same code."""
    model, request = _model_and_request(rng, 4, n_long, 16)

    def nothing(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return torch.zeros_like(value)

    monkeypatch.setattr(model_module, "attend_self", nothing)
    score_err, attention_err = _measure_mutant(monkeypatch, model, request)
    assert score_err > CAUGHT
    assert attention_err > CAUGHT


# -- a divergence the oracle found (fixed): time buckets once computed in float32 ----------

# Integer gaps (seconds) just below a half-octave boundary 2^(k/2) whose float32 log2 rounds up
# onto it, so the model once bucketed them one high; an exhaustive scan finds 35 such gaps below
# 2^24 (above 2^24 the gap itself rounds).
FLOAT32_BOUNDARY_GAPS = [741_455, 1_482_910, 2_097_151, 2_965_819, 4_194_303, 8_388_607]


def test_time_buckets_follow_the_exact_half_octave_rule() -> None:
    cfg = tiny_config()
    bias = RelativeBias(cfg)
    with torch.no_grad():  # weight i = i, so the bias read back is the bucket index
        bias.time_weight.copy_(torch.arange(cfg.num_time_buckets, dtype=torch.float32))
    gaps = torch.tensor(FLOAT32_BOUNDARY_GAPS)
    got = bias.time(gaps, torch.zeros(1, dtype=torch.int64))[:, 0].long().tolist()
    # floor(2 log2 g) = floor(log2 g^2): the bit length of g^2 minus one, in exact integers.
    exact = [min((g * g).bit_length() - 1, cfg.num_time_buckets - 1) for g in FLOAT32_BOUNDARY_GAPS]
    assert got == exact
