"""Every committed benchmark result re-renders its docs section from the file alone.

Each bench/results/NAME.json (smoke runs, *.quick.json, excluded) names the script that made it
in its recorded command; `bench/<script>.py --from-json FILE --no-docs` must print, running
nothing, the section that docs/benchmarks.md holds between `<!-- NAME:start -->` and
`<!-- NAME:end -->`, including when and at which commit the run was made.
"""

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted(
    p for p in (ROOT / "bench" / "results").glob("*.json") if not p.name.endswith(".quick.json")
)
DOCS = ROOT / "docs" / "benchmarks.md"
SCRIPT = re.compile(r"\bbench/(\w+)\.py\b")
MACHINE_FIELDS = ("date", "commit", "machine", "threads")

Rendered = dict[Path, subprocess.CompletedProcess[str] | None]


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def script_of(saved: dict[str, Any]) -> Path | None:
    match = SCRIPT.search(saved.get("command", ""))
    return ROOT / "bench" / f"{match.group(1)}.py" if match else None


def docs_section(name: str) -> str | None:
    """The block of docs/benchmarks.md between NAME's markers, None without them."""
    text = DOCS.read_text()
    start_mark, end_mark = f"<!-- {name}:start -->\n", f"\n<!-- {name}:end -->"
    start = text.find(start_mark)
    end = text.find(end_mark, start)
    return text[start + len(start_mark) : end] if start != -1 and end != -1 else None


def rerender(path: Path) -> subprocess.CompletedProcess[str] | None:
    script = script_of(load(path))
    if script is None:
        return None
    return subprocess.run(
        [sys.executable, str(script), "--from-json", str(path), "--no-docs"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    """Every result re-rendered once, in parallel: each script's process imports torch."""
    with ThreadPoolExecutor(max_workers=max(1, len(RESULTS))) as pool:
        return dict(zip(RESULTS, pool.map(rerender, RESULTS), strict=True))


def printed(rendered: Rendered, path: Path) -> str:
    done = rendered[path]
    assert done is not None, f"{path.name}: its command names no bench/<script>.py"
    assert done.returncode == 0, f"{path.name}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done.stdout


def test_results_are_found() -> None:
    assert RESULTS, "no committed results in bench/results/"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_records_what_made_it(path: Path) -> None:
    saved = load(path)
    script = script_of(saved)
    assert script is not None, f"command {saved.get('command')!r} names no bench/<script>.py"
    assert script.exists(), f"{script} does not exist"
    machine = saved.get("machine", {})
    missing = [k for k in MACHINE_FIELDS if machine.get(k) in (None, "")]
    assert not missing, f"machine info lacks {missing}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_rerenders_its_section(path: Path, rendered: Rendered) -> None:
    out = printed(rendered, path)
    section = docs_section(path.stem)
    assert section is not None, f"docs/benchmarks.md has no {path.stem} section"
    heading = section.splitlines()[0]
    assert heading.startswith("## ") and heading in out.splitlines()
    machine = load(path).get("machine", {})
    for field in ("date", "commit"):
        value = machine.get(field)
        assert value and value in out, f"the section does not show the {field} {value!r}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_rerender_matches_docs(path: Path, rendered: Rendered) -> None:
    out = printed(rendered, path)
    section = docs_section(path.stem)
    assert section is not None, f"docs/benchmarks.md has no {path.stem} section"
    assert section in out, f"docs/benchmarks.md's {path.stem} section is not this result's render"
