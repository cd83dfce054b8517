"""Re-render benchmark results in one interpreter: `python -m tests.unit.rerender_results FILE...`.

For each result file, runs the script its recorded command names as `__main__` with
`--from-json FILE --no-docs` and prints one JSON line: the file, the exit status and what the
script printed. One process imports torch once for all of them (a process per result, 40 at
once, took most of a minute on two CPUs); each script still runs from the file alone.
"""

import contextlib
import io
import json
import re
import runpy
import sys
import traceback
from pathlib import Path

SCRIPT = re.compile(r"\bbench/(\w+)\.py\b")
ROOT = Path(__file__).resolve().parents[2]


def script_of(saved: dict[str, object]) -> Path | None:
    """The bench script a result's recorded command names (None: none)."""
    match = SCRIPT.search(str(saved.get("command", "")))
    return ROOT / "bench" / f"{match.group(1)}.py" if match else None


def rerender(path: Path) -> dict[str, object]:
    """Run the result's script on it: {"path", "script" (None: none named), "returncode",
    "stdout", "stderr"}."""
    script = script_of(json.loads(path.read_text()))
    done: dict[str, object] = {"path": str(path), "script": script and str(script)}
    if script is None:
        return done
    out, err, code = io.StringIO(), io.StringIO(), 0
    argv = sys.argv
    sys.argv = [str(script), "--from-json", str(path), "--no-docs"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except Exception:  # a script's failure is its result's, reported; the others still run
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv = argv
    return done | {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main(paths: list[str]) -> int:
    for path in paths:
        print(json.dumps(rerender(Path(path))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
