"""The relaygr.v1 contract passes `buf lint` (buf.yaml's rule set) and `buf breaking` against its
last release (protos/released.json), and a change that breaks a released field fails the check."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASED = ROOT / "protos" / "released.json"
# `make setup` (make buf) installs the pinned buf from npm and links it beside the interpreter.
BUF = Path(sys.executable).parent / "buf"
COMMON = Path("protos", "relaygr", "v1", "common.proto")
CANDIDATES_FIELD = "  repeated int64 candidate_ids = 6;\n"  # RankRequest's, released


def buf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    if not BUF.exists():
        pytest.fail(f"no buf at {BUF}: run `make setup` (it installs @bufbuild/buf from npm)")
    return subprocess.run(
        [str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def findings(done: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    """buf's findings (`--error-format json`: one JSON object a line)."""
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def contract_copy(tmp_path: Path) -> Path:
    """buf.yaml and protos/ copied to `tmp_path`, to be changed there."""
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "protos" / "relaygr", tmp_path / "protos" / "relaygr")
    return tmp_path


def test_the_contract_passes_lint() -> None:
    done = buf("lint", "--error-format", "json")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_contract_has_no_breaking_change_since_its_release() -> None:
    done = buf("breaking", "--against", str(RELEASED), "--error-format", "json")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_removed_released_field_fails_breaking(tmp_path: Path) -> None:
    copy = contract_copy(tmp_path)
    text = (copy / COMMON).read_text()
    assert text.count(CANDIDATES_FIELD) == 1
    (copy / COMMON).write_text(text.replace(CANDIDATES_FIELD, ""))
    done = buf("breaking", "--against", str(RELEASED), "--error-format", "json", cwd=copy)
    assert done.returncode != 0
    found = findings(done)
    assert [(f["type"], f["path"]) for f in found] == [("FIELD_NO_DELETE", str(COMMON))], found
    message = str(found[0]["message"])
    assert 'field "6" with name "candidate_ids" on message "RankRequest"' in message


def test_a_renumbered_released_field_fails_breaking(tmp_path: Path) -> None:
    copy = contract_copy(tmp_path)
    text = (copy / COMMON).read_text()
    (copy / COMMON).write_text(text.replace("candidate_ids = 6;", "candidate_ids = 16;"))
    done = buf("breaking", "--against", str(RELEASED), "--error-format", "json", cwd=copy)
    assert done.returncode != 0
    assert "FIELD_NO_DELETE" in {f["type"] for f in findings(done)}


def test_lint_refuses_what_its_rule_set_does_not_except(tmp_path: Path) -> None:
    """The exceptions in buf.yaml are narrow: a field name out of the style still fails."""
    copy = contract_copy(tmp_path)
    text = (copy / COMMON).read_text()
    (copy / COMMON).write_text(text.replace("candidate_ids = 6", "candidateIds = 6"))
    done = buf("lint", "--error-format", "json", cwd=copy)
    assert done.returncode != 0
    assert {f["type"] for f in findings(done)} == {"FIELD_LOWER_SNAKE_CASE"}
