"""How many lines each role's decisions and drivers take: the tree issue 25 was filed against
(one flow in the engine, a copy of it in the simulator) beside a later revision (one core, two
drivers).

Issue 25's target is fewer lines than that tree for the same behaviour. Counted per group of
files that carry one behaviour, read from git at both revisions, physical lines and logical
ones (lines holding code: no blank line, comment or docstring, so prose does not count). A group
lists the modules that behaviour lives in at each revision: a module split out of another is in
its group at the later one. Batching (built since) is counted on its own, as it had no earlier
form.

    .venv/bin/python bench/line_count.py              # HEAD against the issue's tree
"""

import argparse
import ast
import contextlib
import io
import subprocess
import tokenize
from dataclasses import dataclass

from bench.pipeline import ROOT, result_name, save_results
from bench.report import add_render_arguments, machine_info, publish, reproduce_lines, run_stamp
from tooling.local.run_stamp import git_output

# The tree issue 25 names ("engine.py (652 lines) ... relaygr/sim/ranker.py (552 lines)"): the
# last commit before its first change.
ISSUE_TREE = "a69cf1feff22fb3df347b844cff1ea20c56c2fe0"
NAME = "line_count"


@dataclass(frozen=True)
class Group:
    """One behaviour and the files it lives in, at the issue's tree and at the later one."""

    behaviour: str
    before: tuple[str, ...]
    after: tuple[str, ...]


GROUPS = (
    Group(
        "the ranker's request flow and scheduling, service and simulator",
        (
            "services/ranker/engine.py",
            "services/ranker/scheduler.py",
            "relaygr/sim/ranker.py",
        ),
        (
            "services/ranker/core.py",
            "services/ranker/core_types.py",
            "services/ranker/flight.py",
            "services/ranker/planner.py",
            "services/ranker/queues.py",
            "services/ranker/engine.py",
            "services/ranker/compute_worker.py",
            "tooling/sim/ranker.py",
        ),
    ),
    Group(
        "the ranker's wiring, registration, drain and hand-off",
        (
            "services/ranker/server.py",
            "services/ranker/handoff.py",
            "services/ranker/handoff_intake.py",
        ),
        (
            "services/ranker/server.py",
            "services/ranker/warm.py",
            "services/ranker/membership.py",
            "services/ranker/handoff.py",
            "services/ranker/handoff_order.py",
            "services/ranker/handoff_intake.py",
        ),
    ),
    Group(
        "the router's forwarding and the simulated fleet",
        ("services/router/forward.py", "relaygr/sim/fleet.py"),
        (
            "services/router/forward.py",
            "services/router/attempts.py",
            "services/router/routes.py",
            "tooling/sim/fleet.py",
        ),
    ),
    Group("batching (built since: no earlier form)", (), ("services/ranker/batching.py",)),
)


def logical_lines(source: str) -> int:
    """Lines holding code: a line with any token that is not a comment or layout, outside the
    docstrings of the module, its classes and functions. A statement over three lines counts
    three."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in layout or token.type == tokenize.ENDMARKER:
            continue
        code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def count(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    """Each file's physical and logical lines."""
    return {
        path: {"lines": len(text.splitlines()), "logical": logical_lines(text)}
        for path, text in sources.items()
    }


def read_at(revision: str, paths: tuple[str, ...]) -> dict[str, str]:
    """The text at `revision` of those of the files it holds (an earlier revision may lack a
    module split out later: it counts nothing there)."""
    texts = {}
    for path in paths:
        with contextlib.suppress(subprocess.CalledProcessError):  # not in that tree
            texts[path] = git_output("show", f"{revision}:{path}")
    return texts


def run(args: argparse.Namespace) -> dict:
    stamp = machine_info()
    after = args.commit
    groups = [
        {
            "behaviour": g.behaviour,
            "before": count(read_at(ISSUE_TREE, g.before)),
            "after": count(read_at(after, g.after)),
        }
        for g in GROUPS
    ]
    results = {"issue_tree": ISSUE_TREE, "revision": after, "groups": groups}
    return save_results(NAME, args, results, stamp)


def _sum(files: dict[str, dict[str, int]], key: str) -> int:
    return sum(f[key] for f in files.values())


def render(saved: dict) -> str:
    lines = [
        f"## Lines per behaviour: the issue's tree against one core, two drivers at "
        f"{saved['revision'][:7]}",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. Counted at {saved['issue_tree'][:7]} (the tree issue "
        f"25 was filed against) and at {saved['revision'][:7]}. Logical lines hold code: no "
        "blank line, comment or docstring.",
        "",
        "| behaviour | files then | files now | lines then | lines now | logical then "
        "| logical now | logical now / then |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    totals = {"lines": [0, 0], "logical": [0, 0]}
    for g in saved["groups"]:
        row = []
        for key in ("lines", "logical"):
            then, now = _sum(g["before"], key), _sum(g["after"], key)
            totals[key][0] += then
            totals[key][1] += now
            row += [then, now]
        ratio = f"{row[3] / row[2]:.2f}" if row[2] else "-"
        lines.append(
            f"| {g['behaviour']} | {len(g['before'])} | {len(g['after'])} | {row[0]:,} | "
            f"{row[1]:,} | {row[2]:,} | {row[3]:,} | {ratio} |"
        )
    (lt, ln), (gt, gn) = totals["lines"], totals["logical"]
    lines.append(f"| all of them | | | {lt:,} | {ln:,} | {gt:,} | {gn:,} | {gn / gt:.2f} |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--revision",
        default="HEAD",
        help="the later tree (default: HEAD; another is saved as line_count_<commit>.json)",
    )
    add_render_arguments(p)
    args = p.parse_args(argv)
    # What `save_results` names and stamps a result by: it draws no seed, and a revision other
    # than HEAD is saved (and its section named) as line_count_<commit>.
    args.commit = git_output("rev-parse", args.revision).strip()
    args.seed, args.quick = None, False
    args.tag = "" if args.revision == "HEAD" else args.commit[:7]
    return args


def main() -> int:
    args = parse()
    name = result_name(NAME, args) if args.from_json is None else args.from_json.stem
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
