"""A small `relaygr up` mesh for process-level tests: rankers serving the tiny test model."""

import glob
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.ranker.model import RankingModel
from services.ranker.model_config import PRESETS, ModelPreset
from tooling.local.mesh import MeshSpec
from tooling.local.ports import free_port_range as free_ports  # noqa: F401 (re-exported for the tests)


def tiny_mesh(**spec: Any) -> tuple[MeshSpec, RankingModel]:
    """A MeshSpec whose CPU rankers serve the tiny preset (quick calibration), and the same
    model in this process for reference scores. `spec` sets any other MeshSpec field."""
    ranker_args = ("--model", "tiny", "--device", "cpu", "--calibration-lengths", "32,64")
    fields = {"rankers": 2, **spec}
    fields["ranker_args"] = (*ranker_args, *fields.get("ranker_args", ()))
    return MeshSpec(**fields), RankingModel(PRESETS[ModelPreset.TINY], seed=0)


def mesh_workdirs() -> set[str]:
    """The local meshes' temporary directories that exist now."""
    return set(glob.glob(f"{tempfile.gettempdir()}/relaygr-mesh-*"))


@pytest.fixture
def private_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temporary directory of this test's own for everything that asks `tempfile` (and, through
    TMPDIR, its children), so `mesh_workdirs()` sees only this test's meshes, not another
    process's running on the same machine."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    yield private
