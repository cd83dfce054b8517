"""PrefixKV storage: dtype error bounds, byte accounting and device moves."""

import numpy as np
import pytest
import torch

from services.ranker.model import RankingModel
from services.ranker.model_config import KVDtype

from .factories import prefix, rank_input, rel_err, tiny_config

# Bound: one unit roundoff of the storage format (bf16: 8 significant bits, u = 2^-8;
# fp16: 11 bits, u = 2^-11). Each cached K/V element is rounded once, with relative error <= u;
# an attention output is a weighted sum of rounded values, so to first order its relative error
# is <= u too, and layer norms and projections downstream do not amplify it. Measured errors
# sit 5-20x below these bounds (bf16 ~3e-4..8e-4, fp16 ~2e-5..8e-5 relative to the score scale).
STORAGE_BOUNDS = {KVDtype.BFLOAT16: 2.0**-8, KVDtype.FLOAT16: 2.0**-11}


@pytest.mark.parametrize("kv_dtype", [KVDtype.BFLOAT16, KVDtype.FLOAT16])
def test_reduced_precision_storage_error_is_bounded(
    rng: np.random.Generator, kv_dtype: KVDtype
) -> None:
    model = RankingModel(tiny_config(kv_dtype=kv_dtype), seed=int(rng.integers(0, 2**31)))
    worst = 0.0
    for n_long in (10, 500, 2000):
        request = rank_input(rng, prefix(rng, n_long), n_short=64, n_candidates=64)
        kv = model.prefill(request.prefix)
        assert kv.keys.dtype == kv.values.dtype == kv_dtype.torch_dtype
        cached = model.rank(kv, request.short_term, request.candidates, request.request_ts)
        worst = max(worst, rel_err(cached, model.full_forward(request)))
    print(f"{kv_dtype.value} storage: worst relative score error {worst:.2e}")
    assert worst <= STORAGE_BOUNDS[kv_dtype]
    assert worst > 0.0  # the cache really is stored rounded


def test_nbytes_matches_config_and_halves_in_bf16(rng: np.random.Generator) -> None:
    p = prefix(rng, 300, n_user=5)
    sizes = {}
    for kv_dtype in KVDtype:
        cfg = tiny_config(kv_dtype=kv_dtype)
        kv = RankingModel(cfg, seed=1).prefill(p)
        assert kv.num_tokens == 305 and kv.num_behaviours == 300 and kv.num_user_tokens == 5
        assert kv.nbytes == 305 * cfg.kv_bytes_per_token + 305 * 8  # K/V plus int64 timestamps
        sizes[kv_dtype] = kv.nbytes - 305 * 8
    assert sizes[KVDtype.BFLOAT16] * 2 == sizes[KVDtype.FLOAT32] == sizes[KVDtype.FLOAT16] * 2


def test_to_same_device_is_identity_and_carries_identity(rng: np.random.Generator) -> None:
    model = RankingModel(tiny_config(), seed=1)
    kv = model.prefill(prefix(rng, 20))
    assert kv.to("cpu") is kv
    moved = kv.to(torch.device("meta"))
    assert moved.device.type == "meta" and moved.keys.shape == kv.keys.shape
    assert moved.digest == kv.digest and moved.model_version == kv.model_version
    assert moved.nbytes == kv.nbytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_relay_round_trip(rng: np.random.Generator) -> None:
    """Prefill on the GPU, park the cache in host memory, bring it back: still exact."""
    model = RankingModel(tiny_config(), seed=1, device="cuda")
    request = rank_input(rng, prefix(rng, 700))
    kv = model.prefill(request.prefix).to("cpu").to(model.device)
    cached = model.rank(kv, request.short_term, request.candidates, request.request_ts)
    assert rel_err(cached.cpu(), model.full_forward(request).cpu()) <= 1e-5
