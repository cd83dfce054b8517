"""Shared benchmark reporting: what a run records, re-rendering it, sections of a Markdown doc."""

import argparse
import json
import random
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tooling.local.compliance import RatePoint, highest_compliant, max_compliant
from tooling.local.run_stamp import cpu_model, git_commit, machine_info

T = TypeVar("T")

DOC_TITLE = (
    "# Benchmarks\n\n"
    "Measured performance of RelayGR components; each section holds its latest run.\n"
)


def rotated(items: Sequence[T], k: int) -> list[T]:
    """`items` starting from the k-th (modulo their count): who goes first rotates from one
    round to the next, so the host's drift falls on each alike."""
    k %= len(items) or 1
    return [*items[k:], *items[:k]]


def reproduce_lines(saved: dict[str, Any]) -> list[str]:
    """The lines under a section's title: the command that reproduces its run, set apart."""
    return ["", f"Reproduce: `{saved['command']}`.", ""]


def run_stamp(info: dict[str, Any]) -> str:
    """When, at which commit and where a run was made: the head of a section's first bullet."""
    return f"Date: {info['date']}; commit: {info['commit']}; machine: {info['machine']}"


def reproduce_command(script: str, seed: int | None) -> str:
    """The command line that reruns this benchmark: its own arguments, plus the seed it drew
    (None: it draws none)."""
    command = shlex.join([".venv/bin/python", f"bench/{script}.py", *sys.argv[1:]])
    if seed is not None and "--seed" not in sys.argv:
        command += f" --seed {seed}"
    return command


# What every saved result records, so that its section can be re-rendered and traced.
RECORDED = ("command", "machine")
RECORDED_MACHINE = ("date", "commit", "machine", "threads")


def comma_ints(text: str) -> list[int]:
    """An option's "N,N,..." as integers (argparse `type=`)."""
    return [int(s) for s in text.split(",")]


def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    """--no-docs and --from-json: every benchmark can re-render a saved result, running nothing."""
    parser.add_argument("--no-docs", action="store_true", help="only print; do not update docs/")
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="re-render the section from saved results (bench/results/*.json), run nothing"
        " (default: none: run the benchmark)",
    )


def add_run_arguments(parser: argparse.ArgumentParser, quick: str = "smoke run") -> None:
    """--seed, --quick and --tag, then the render options (`add_render_arguments`); read them
    with `parse_run`, which draws the seed when none is given."""
    parser.add_argument("--seed", type=int, default=None, help="default: random")
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--tag", default="", help="suffix of the result file")
    add_render_arguments(parser)


def parse_run(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser`'s arguments, with a seed drawn at random when none was given (the reproducing
    command then carries it: `reproduce_command`)."""
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**32)
    return args


def load_result(path: Path) -> dict[str, Any]:
    """A saved result, checked to record what produced it (command, date, commit, machine)."""
    saved = json.loads(path.read_text())
    missing = [k for k in RECORDED if k not in saved]
    missing += [f"machine.{k}" for k in RECORDED_MACHINE if k not in saved.get("machine", {})]
    if missing:
        raise SystemExit(f"{path}: the result does not record {', '.join(missing)}")
    return saved


# A JSON array of numbers only (no nested array or object), as `json.dumps(indent=2)` lays it out.
_NUMBERS = re.compile(r"\[\n\s*(-?[0-9][-+.0-9eE]*(?:,\n\s*-?[0-9][-+.0-9eE]*)*)\n\s*\]")


def dumps_result(saved: dict[str, Any]) -> str:
    """A result as indented JSON, each array of numbers on one line: per-Rank latencies stay a
    line a point, not a line a Rank (files stay small and diffs readable)."""
    text = json.dumps(saved, indent=2)
    return _NUMBERS.sub(lambda m: "[" + ", ".join(re.split(r",\n\s*", m.group(1))) + "]", text)


def publish(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    section: Path,
    name: str,
) -> dict[str, Any]:
    """Run the benchmark (or load `--from-json`), print its section and, unless `--no-docs`,
    write it into `section`'s marked block `name`. Returns the saved result."""
    saved = load_result(args.from_json) if args.from_json is not None else run(args)
    text = render(saved)
    print(text)
    if not args.no_docs:
        write_section(section, name, text)
    return saved


def splice_section(text: str | None, name: str, section: str) -> str:
    """`text` with the block between `<!-- name:start -->` and `<!-- name:end -->` replaced."""
    start_mark, end_mark = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start_mark}\n{section.strip()}\n{end_mark}"
    if not text:
        return f"{DOC_TITLE}\n{block}\n"
    start, end = text.find(start_mark), text.find(end_mark)
    if start == -1 or end == -1 or end < start:
        return text.rstrip() + f"\n\n{block}\n"
    return text[:start] + block + text[end + len(end_mark) :]


def write_section(path: Path, name: str, section: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else None
    path.write_text(splice_section(text, name, section))


# Re-exported for the benchmarks: the compliance rules live in tooling.local.compliance, the
# run's stamp in tooling.local.run_stamp.
__all__ = [
    "RatePoint",
    "cpu_model",
    "git_commit",
    "highest_compliant",
    "machine_info",
    "max_compliant",
]
