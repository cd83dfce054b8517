"""Cost model: the fit recovers known coefficients; calibration yields a usable model."""

import numpy as np
import pytest
import torch

from relaygr.cost import CostModel
from services.ranker.cost_model import Sample, calibrate, fit_cost_model, measure
from services.ranker.model import RankingModel

from .factories import tiny_config


def test_fit_recovers_the_generating_coefficients(rng: np.random.Generator) -> None:
    truth = CostModel(2.0, 0.05, 2e-5, 1e-4, reload_ms_per_mb=0.3)
    samples = []
    for tokens in (128, 512, 1024, 2048, 4096):
        for candidates in (0, 64, 256):
            noise = float(rng.normal(1.0, 0.01))
            samples.append(Sample(tokens, candidates, truth.full_ms(tokens, candidates) * noise))
    fitted = fit_cost_model(samples, reload_ms_per_mb=0.3)
    for tokens, candidates in ((3000, 128), (8000, 256)):
        assert fitted.full_ms(tokens, candidates) == pytest.approx(
            truth.full_ms(tokens, candidates), rel=0.05
        )
    assert fitted.prefill_ms(4096) == pytest.approx(truth.prefill_ms(4096), rel=0.05)


def test_fit_never_returns_negative_coefficients() -> None:
    # Pure linear timings: the quadratic terms must come out zero, not negative.
    samples = [Sample(t, c, 1.0 + 0.01 * (t + c)) for t in (100, 200, 400) for c in (0, 10)]
    fitted = fit_cost_model(samples, reload_ms_per_mb=1.0)
    coefficients = (
        fitted.fixed_ms, fitted.per_token_ms, fitted.per_pair_ms, fitted.per_candidate_key_ms
    )  # fmt: skip
    assert min(coefficients) >= 0.0
    assert fitted.full_ms(1000, 10) == pytest.approx(1.0 + 0.01 * 1010, rel=0.01)


def test_reload_is_chosen_only_when_cheaper() -> None:
    model = CostModel(0.0, 0.01, 0.0, 0.0, reload_ms_per_mb=1.0)
    assert model.reload_is_cheaper(nbytes=2**20, tokens=1000)  # 1 ms vs 10 ms
    assert not model.reload_is_cheaper(nbytes=2**20, tokens=50)  # 1 ms vs 0.5 ms


def test_calibration_on_this_device_predicts_growth() -> None:
    model = RankingModel(tiny_config(), seed=1)
    # Median of three interleaved runs per length, fitted robustly: one run slowed by load
    # elsewhere on the host no longer bends the fit. One intra-op thread, as each ranker of a
    # local mesh runs: on a loaded host, several threads' barriers wait for descheduled peers,
    # and every call of this tiny model then takes the same ~100s of ms whatever its length.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cost = calibrate(model, lengths=(64, 256, 1024), candidates=16)
    finally:
        torch.set_num_threads(threads)
    assert cost.full_ms(2048, 16) > cost.full_ms(256, 16) > 0
    assert cost.reload_ms_per_mb > 0
    # The cached rank has terms of its own, fitted to the Ranks timed on each prefix.
    assert cost.prices_cached_ranks
    assert cost.rank_ms(2048, 32, 16) > cost.rank_ms(256, 32, 16) > 0


def test_calibration_times_two_cached_ranks_per_length_within_the_history_limit() -> None:
    # Rows and keys both vary between the two, so their terms can be told apart; a prefix at
    # the model's limit leaves no room for short-term behaviours (the model would refuse it).
    cfg = tiny_config(max_history_tokens=256, max_candidates=24)
    ticks = iter(range(10**6))
    samples = measure(
        RankingModel(cfg, seed=1), (64, 1000), candidates=16, repeats=1,
        timer=lambda: float(next(ticks)),
    )  # fmt: skip
    ranks = [(s.cached_tokens, s.tokens, s.candidates) for s in samples if s.is_cached_rank]
    assert ranks == [(64, 64, 16), (64, 192, 24), (256, 256, 16), (256, 256, 24)]
    assert all(s.ms == 1000.0 for s in samples if s.is_cached_rank)  # one tick each
