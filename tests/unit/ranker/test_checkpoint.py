"""Checkpoints and model versions: content decides the version; a round trip preserves scores."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaygr.errors import ConfigError
from services.ranker.checkpoint import load_checkpoint, save_checkpoint
from services.ranker.model import RankingModel

from .factories import prefix, rank_input, tiny_config


def test_version_is_derived_from_content() -> None:
    cfg = tiny_config()
    same = RankingModel(cfg, seed=5), RankingModel(cfg, seed=5)
    assert same[0].model_version == same[1].model_version
    assert RankingModel(cfg, seed=6).model_version != same[0].model_version
    assert RankingModel(tiny_config(num_layers=2), seed=5).model_version != same[0].model_version
    nudged = RankingModel(cfg, seed=5)
    with torch.no_grad():
        nudged.task_head.bias[0] += 1e-3
    nudged.refresh_version()
    assert nudged.model_version != same[0].model_version


def test_round_trip_preserves_version_and_scores(tmp_path: Path, rng: np.random.Generator) -> None:
    model = RankingModel(tiny_config(), seed=int(rng.integers(0, 2**31)))
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.model_version == model.model_version
    assert loaded.cfg == model.cfg
    request = rank_input(rng, prefix(rng, 80))
    assert torch.equal(loaded.full_forward(request), model.full_forward(request))
    # A cache made by the original is usable by the loaded copy: same version.
    kv = model.prefill(request.prefix)
    assert torch.equal(
        loaded.rank(kv, request.short_term, request.candidates, request.request_ts),
        model.rank(kv, request.short_term, request.candidates, request.request_ts),
    )


def test_bad_checkpoints_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read checkpoint config"):
        load_checkpoint(tmp_path / "missing")
    path = save_checkpoint(RankingModel(tiny_config(), seed=1), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_layerz": 2}))
    with pytest.raises(ConfigError, match=r"unknown model config keys \['num_layerz'\]"):
        load_checkpoint(path)
    (path / "config.json").write_text(json.dumps({**config, "d_model": 32}))
    with pytest.raises(ConfigError, match="do not match its config"):
        load_checkpoint(path)
