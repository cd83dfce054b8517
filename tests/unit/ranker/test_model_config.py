"""Model configuration validation names the offending field and the valid values."""

import pytest

from relaygr.errors import ConfigError
from services.ranker.model_config import KVDtype, ModelConfig


def test_defaults_round_trip_through_a_dict() -> None:
    cfg = ModelConfig()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict({"kv_dtype": "bfloat16"}).kv_dtype is KVDtype.BFLOAT16


def test_kv_bytes_per_token() -> None:
    cfg = ModelConfig(num_layers=3, num_heads=2, d_qk=64, d_v=128, kv_dtype=KVDtype.BFLOAT16)
    assert (cfg.k_bytes_per_token, cfg.v_bytes_per_token) == (3 * 2 * 64 * 2, 3 * 2 * 128 * 2)
    assert cfg.kv_bytes_per_token == 3 * 2 * (64 + 128) * 2
    assert cfg.cache_bytes_per_token == cfg.kv_bytes_per_token + 8  # and the int64 timestamp


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_layers": 0}, "num_layers must be > 0, got 0"),
        ({"ffn_mult": -1}, "ffn_mult must be >= 0"),
        ({"num_actions": 1}, "num_actions must be >= 2"),
        ({"tasks": []}, "tasks must be non-empty and unique"),
        ({"tasks": ["a", "a"]}, "tasks must be non-empty and unique"),
        ({"kv_dtype": "int8"}, "kv_dtype 'int8' is not one of: float32, bfloat16, float16"),
    ],
)
def test_invalid_values_are_named(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(changes)
