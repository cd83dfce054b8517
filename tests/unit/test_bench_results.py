"""Every committed benchmark result re-renders its docs section from the file alone.

Each bench/results/NAME.json (smoke runs, *.quick.json, excluded) names the script that made it
in its recorded command; `bench/<script>.py --from-json FILE --no-docs` must print, running
nothing, the section that docs/benchmarks.md holds between `<!-- NAME:start -->` and
`<!-- NAME:end -->`, including when and at which commit the run was made.
"""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.unit.rerender_results import script_of

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted(
    p for p in (ROOT / "bench" / "results").glob("*.json") if not p.name.endswith(".quick.json")
)
DOCS = ROOT / "docs" / "benchmarks.md"
MACHINE_FIELDS = ("date", "commit", "machine", "threads")

Rendered = dict[Path, subprocess.CompletedProcess[str] | None]


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def docs_section(name: str) -> str | None:
    """The block of docs/benchmarks.md between NAME's markers, None without them."""
    text = DOCS.read_text()
    start_mark, end_mark = f"<!-- {name}:start -->\n", f"\n<!-- {name}:end -->"
    start = text.find(start_mark)
    end = text.find(end_mark, start)
    return text[start + len(start_mark) : end] if start != -1 and end != -1 else None


def rerender(paths: list[Path]) -> Rendered:
    """Each of `paths` re-rendered by its script, all in one interpreter besides this one
    (`tests.unit.rerender_results`: torch is imported once, not once per result)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.rerender_results", *map(str, paths)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rendered: Rendered = {}
    for line in done.stdout.splitlines():
        r = json.loads(line)
        path = Path(r["path"])
        rendered[path] = None if r["script"] is None else subprocess.CompletedProcess(
            [r["script"]], r["returncode"], r["stdout"], r["stderr"]
        )  # fmt: skip
    return rendered


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    """Every result re-rendered once, in two interpreters side by side."""
    halves = [RESULTS[0::2], RESULTS[1::2]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return {path: r for half in pool.map(rerender, halves) for path, r in half.items()}


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
