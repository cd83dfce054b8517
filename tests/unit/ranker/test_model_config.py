"""Model configuration validation names the offending field and the valid values."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from relaygr.errors import ConfigError
from services.ranker.config import RankerConfig
from services.ranker.model_config import PRESETS, KVDtype, ModelConfig, ModelPreset
from services.ranker.server import load_model


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


def test_every_preset_is_a_distinct_valid_config() -> None:
    assert set(PRESETS) == set(ModelPreset)
    assert PRESETS[ModelPreset.DEFAULT] == ModelConfig()
    assert len({cfg.to_dict()["d_model"] for cfg in PRESETS.values()}) == len(PRESETS)


def test_the_ranker_builds_its_preset_with_the_model_config_files_fields_over_it(
    tmp_path: Path,
) -> None:
    overrides = tmp_path / "model.json"
    overrides.write_text(json.dumps({"max_candidates": 16}))
    cfg = RankerConfig(plaintext=True, device="cpu", model=ModelPreset.TINY, model_config=overrides)
    assert load_model(cfg).cfg == replace(PRESETS[ModelPreset.TINY], max_candidates=16)
    overrides.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_model(cfg)


def test_a_ranker_refuses_an_unknown_preset_or_a_preset_with_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ranker model must be one of \['tiny', 'small', "):
        RankerConfig(plaintext=True, model="huge")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="either checkpoint or model"):
        RankerConfig(plaintext=True, model=ModelPreset.SMALL, checkpoint=tmp_path)
