"""Measured profiles: a ranker's Describe reply as a DeviceProfile, and the mean of a mesh's."""

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from relaygr.cost import CostModel
from relaygr.errors import InvalidInput
from relaygr.v1 import ranker_pb2
from tooling.sim.measured import mean_profile, profile_of
from tooling.sim.profile import MIB

WHEN = datetime(2026, 12, 5, 9, 30, 15, tzinfo=UTC)


def info(instance: str = "ranker-0", per_token_ms: float = 0.16) -> ranker_pb2.RankerInfo:
    """A Describe reply as a CPU ranker of the small model sends it."""
    return ranker_pb2.RankerInfo(
        instance_id=instance,
        model_version="mv1",
        device="cpu",
        dims=ranker_pb2.ModelDims(
            layers=3,
            d_model=256,
            kv_dtype="float32",
            k_bytes_per_token=3072,
            v_bytes_per_token=3072,
            timestamp_bytes_per_token=8,
            cache_bytes_per_token=6152,
        ),
        hbm=ranker_pb2.TierUsage(budget_bytes=128 * MIB, used_bytes=5 * MIB),
        dram=ranker_pb2.TierUsage(budget_bytes=512 * MIB),
        cost_model=ranker_pb2.CostModel(
            fixed_ms=6.0,
            per_token_ms=per_token_ms,
            per_pair_ms=7e-5,
            per_candidate_key_ms=2e-4,
            reload_ms_per_mb=0.5,
            median_abs_rel_error=0.02,
            samples=12,
            batch_saving_ms=1.5,
            batch_samples=6,
            cached_fixed_ms=2.5,
            cached_per_row_ms=0.03,
            cached_per_key_ms=per_token_ms / 100,
            cached_per_row_key_ms=2e-5,
        ),
        relay_enabled=True,
        intra_op_threads=1,
    )


def test_describe_becomes_a_measured_profile() -> None:
    profile = profile_of(info(), "127.0.0.1:4242", WHEN)
    assert profile.kind == "measured"
    assert profile.cost == CostModel(
        6.0, 0.16, 7e-5, 2e-4, 0.5, 0.02, 12, 1.5, 6,
        cached_fixed_ms=2.5, cached_per_row_ms=0.03, cached_per_key_ms=0.0016,
        cached_per_row_key_ms=2e-5,
    )  # fmt: skip
    assert profile.device_tier_bytes == 128 * MIB  # the budget, not what is used
    assert profile.host_tier_bytes == 512 * MIB
    assert profile.kv_bytes_per_token == 6152  # K, V and the timestamp
    assert profile.request_overhead_ms == 0.0  # not published: the caller measures it
    assert profile.compute_noise == pytest.approx(0.02 / 0.6745)
    assert profile.sources == (
        "Describe of ranker ranker-0 at 127.0.0.1:4242, 2026-12-05 09:30:15 UTC: cost model "
        "fitted to 12 timed runs (median |rel error| 2.0%)",
    )
    assert "cpu, 1 intra-op thread(s)" in profile.description


def test_a_reply_without_cache_bytes_per_token_is_refused() -> None:
    old = info()
    old.dims.cache_bytes_per_token = 0
    with pytest.raises(InvalidInput, match="cache_bytes_per_token"):
        profile_of(old, "127.0.0.1:4242", WHEN)


def test_the_mean_of_a_mesh_predicts_the_mean_prediction() -> None:
    a = replace(profile_of(info("ranker-0", 0.10), "a:1", WHEN), request_overhead_ms=2.0)
    b = replace(profile_of(info("ranker-1", 0.20), "b:1", WHEN), request_overhead_ms=4.0)
    mean = mean_profile([a, b], "mesh")
    assert mean.name == "mesh" and mean.kind == "measured"
    assert mean.cost.per_token_ms == pytest.approx(0.15)
    assert mean.cost.cached_per_key_ms == pytest.approx(0.0015)
    assert mean.cost.rank_ms(4096, 64, 128) == pytest.approx(
        (a.cost.rank_ms(4096, 64, 128) + b.cost.rank_ms(4096, 64, 128)) / 2
    )
    assert mean.cost.samples == 24
    assert mean.request_overhead_ms == pytest.approx(3.0)
    full = [p.cost.full_ms(3000, 128) for p in (a, b)]
    assert mean.cost.full_ms(3000, 128) == pytest.approx(sum(full) / 2)
    assert mean.sources == a.sources + b.sources
    assert mean.assumptions == a.assumptions  # the same assumptions, kept once
    assert mean.device_tier_bytes == 128 * MIB


def test_the_mean_needs_one_model() -> None:
    a = profile_of(info(), "a:1", WHEN)
    with pytest.raises(InvalidInput, match="different models"):
        mean_profile([a, replace(a, kv_bytes_per_token=1000)], "mesh")
    with pytest.raises(InvalidInput, match="no profile"):
        mean_profile([], "mesh")
