"""Checkpoints: a model is its config plus its weights; its version is derived from both."""

import json
from pathlib import Path

import torch

from relaygr.errors import ConfigError
from services.ranker.model import RankingModel
from services.ranker.model_config import ModelConfig

_CONFIG_FILE = "config.json"
_WEIGHTS_FILE = "weights.pt"


def save_checkpoint(model: RankingModel, directory: Path | str) -> Path:
    """Write `config.json` and `weights.pt` into `directory` (created if missing)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / _CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2, sort_keys=True))
    weights = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    torch.save(weights, path / _WEIGHTS_FILE)
    return path


def load_checkpoint(directory: Path | str, device: torch.device | str = "cpu") -> RankingModel:
    """The model saved in `directory`, on `device`; its version is recomputed from content."""
    path = Path(directory)
    try:
        config = json.loads((path / _CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read checkpoint config {path / _CONFIG_FILE}: {err}") from err
    model = RankingModel(ModelConfig.from_dict(config), device=device)
    try:
        weights = torch.load(path / _WEIGHTS_FILE, map_location=model.device, weights_only=True)
    except (OSError, RuntimeError) as err:
        raise ConfigError(f"cannot read checkpoint weights {path / _WEIGHTS_FILE}: {err}") from err
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise ConfigError(f"checkpoint weights do not match its config: {err}") from err
    model.refresh_version()
    return model
