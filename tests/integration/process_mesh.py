"""A small `relaygr up` mesh for process-level tests: rankers serving the tiny test model."""

import glob
import json
import tempfile
from pathlib import Path
from typing import Any

from relaygr.local.mesh import MeshSpec
from services.ranker.model import RankingModel
from tests.unit.ranker.factories import tiny_config


def tiny_mesh(tmp_path: Path, **spec: Any) -> tuple[MeshSpec, RankingModel]:
    """A MeshSpec whose CPU rankers serve `tiny_config()` (quick calibration), and the same
    model in this process for reference scores. `spec` sets any other MeshSpec field."""
    config = tiny_config()
    model_path = tmp_path / "model.json"
    model_path.write_text(json.dumps(config.to_dict()))
    ranker_args = (
        "--model-config", str(model_path), "--device", "cpu", "--calibration-lengths", "32,64",
    )  # fmt: skip
    fields = {"rankers": 2, **spec}
    fields["ranker_args"] = (*ranker_args, *fields.get("ranker_args", ()))
    return MeshSpec(**fields), RankingModel(config, seed=0)


def mesh_workdirs() -> set[str]:
    """The local meshes' temporary directories that exist now."""
    return set(glob.glob(f"{tempfile.gettempdir()}/relaygr-mesh-*"))
