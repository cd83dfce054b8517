"""Chunk spans of a prefill or extension and their predicted times."""

import pytest

from relaygr.cost import CostModel
from services.ranker.chunks import chunk_ms, extension_spans, prefill_spans

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
