"""Chunk spans of a prefill or extension and their predicted times."""

from dataclasses import replace

import numpy as np
import pytest

from relaygr.cost import CostModel
from relaygr.errors import ConfigError
from services.ranker.chunks import (
    background_chunk,
    chunk_ms,
    extension_span,
    extension_spans,
    prefill_span,
    prefill_spans,
)
from services.ranker.config import RankerConfig

COST = CostModel(2.0, 0.05, 2e-5, 1e-4, reload_ms_per_mb=0.3)


def test_prefill_spans_fill_the_first_chunk_with_user_features_then_step_by_chunk() -> None:
    assert prefill_spans(4, 100, 64) == [(0, 64), (64, 104)]
    assert prefill_spans(4, 300, 64) == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 304)]
    assert prefill_spans(4, 10, 64) == [(0, 14)]
    assert prefill_spans(4, 100, 104) == [(0, 104)]  # one call


def test_extension_spans_start_from_the_cached_behaviours() -> None:
    assert extension_spans(4, 100, 140, 64) == [(104, 144)]
    assert extension_spans(4, 100, 300, 64) == [(104, 168), (168, 232), (232, 296), (296, 304)]
    assert extension_spans(4, 100, 100, 64) == []


def test_chunks_cost_one_prefill_plus_a_fixed_cost_per_extra_call() -> None:
    assert chunk_ms(COST, (0, 304)) == pytest.approx(COST.prefill_ms(304))
    spans = prefill_spans(4, 300, 64)
    total = sum(chunk_ms(COST, s) for s in spans)
    assert total == pytest.approx(COST.prefill_ms(304) + (len(spans) - 1) * COST.fixed_ms)


def _steps(user_features: int, start: int, behaviours: int, chunk: int) -> list[tuple[int, int]]:
    """An independent statement of the chunking: `chunk` behaviours a step from `start`."""
    return [
        (user_features + begin, user_features + min(begin + chunk, behaviours))
        for begin in range(start, behaviours, chunk)
    ]


def test_each_step_and_the_lists_match_an_independent_statement(rng: np.random.Generator) -> None:
    for _ in range(500):
        user_features, chunk = int(rng.integers(0, 20)), int(rng.integers(1, 200))
        behaviours, start = int(rng.integers(0, 2000)), int(rng.integers(0, 2000))
        first = max(chunk - user_features, 0)
        whole = [(0, user_features + min(first, behaviours))]
        whole += _steps(user_features, first, behaviours, chunk)
        assert prefill_spans(user_features, behaviours, chunk) == whole
        assert [prefill_span(user_features, behaviours, chunk, k) for k in range(len(whole))] == (
            whole
        )
        with pytest.raises(IndexError):
            prefill_span(user_features, behaviours, chunk, len(whole))
        more = _steps(user_features, start, behaviours, chunk)
        assert extension_spans(user_features, start, behaviours, chunk) == more
        assert [
            extension_span(user_features, start, behaviours, chunk, k) for k in range(len(more))
        ] == more
        with pytest.raises(IndexError):
            extension_span(user_features, start, behaviours, chunk, len(more))


def _fixed_share(cost: CostModel, tokens: int) -> float:
    """The share of a `tokens`-token call's time, pairs left out, that is its fixed cost."""
    return cost.fixed_ms / (cost.fixed_ms + cost.per_token_ms * tokens)


def test_a_background_chunk_grows_until_the_call_cost_is_its_share() -> None:
    h100 = CostModel(1.0, 1.017e-3, 3.974e-7, 3.974e-7, reload_ms_per_mb=0.02)
    assert background_chunk(h100, 512, 0.25, 4096) == 3072  # 2,950 tokens needed
    assert _fixed_share(h100, 3072) <= 0.25 < _fixed_share(h100, 2560)
    cpu = CostModel(8.0, 0.16, 1e-5, 1e-5, reload_ms_per_mb=0.3)  # a calibrated CPU mesh
    assert background_chunk(cpu, 512, 0.25, 4096) == 512  # 150 tokens would do: never shrinks
    assert background_chunk(h100, 512, 1.0, 4096) == 512  # 1: never grows
    assert background_chunk(h100, 512, 0.25, 2048) == 2048  # capped
    assert background_chunk(replace(h100, per_token_ms=0.0), 512, 0.25, 4096) == 4096


def test_a_background_chunk_is_the_least_multiple_within_its_share(
    rng: np.random.Generator,
) -> None:
    for _ in range(500):
        cost = CostModel(
            float(rng.uniform(0.0, 10.0)), float(rng.uniform(1e-4, 0.5)), 0.0, 0.0,
            reload_ms_per_mb=0.0,
        )  # fmt: skip
        least, most = int(rng.integers(1, 1024)), int(rng.integers(1, 8192))
        share = float(rng.uniform(0.01, 1.0))
        chunk = background_chunk(cost, least, share, most)
        if most <= least:
            assert chunk == least
            continue
        assert least <= chunk <= most
        assert chunk == most or chunk % least == 0
        if chunk < most:
            assert _fixed_share(cost, chunk) <= share + 1e-12
        if chunk > least:
            assert _fixed_share(cost, chunk - least) > share - 1e-12


@pytest.mark.parametrize("share", [0.0, -0.25, 1.5])
def test_a_ranker_refuses_a_fixed_share_outside_zero_to_one(share: float) -> None:
    with pytest.raises(ConfigError, match="prefill_chunk_fixed_share must be in"):
        RankerConfig(prefill_chunk_fixed_share=share)
