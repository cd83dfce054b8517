"""The line count behind issue 25's "fewer lines for the same behaviour": what counts as a line of
code, and that every file a group names exists at the revision it is counted at."""

import subprocess
import textwrap

from bench.line_count import GROUPS, ISSUE_TREE, logical_lines, render
from bench.pipeline import ROOT


def test_docstrings_comments_and_blank_lines_are_not_code() -> None:
    source = textwrap.dedent(
        '''\
        """A module docstring
        over two lines."""

        # a comment
        import os


        class A:
            """A class docstring."""

            def f(self) -> int:  # a trailing comment
                """A function docstring."""
                return 1
        '''
    )
    # import, class, def, return
    assert logical_lines(source) == 4


def test_each_line_of_a_statement_counts_and_a_string_that_is_data_counts() -> None:
    source = textwrap.dedent(
        """\
        x = (
            1,
            2,
        )
        MESSAGE = \"\"\"not a docstring:
        an assignment\"\"\"
        """
    )
    assert logical_lines(source) == 6


def test_every_file_a_group_names_is_in_the_tree_it_is_counted_at() -> None:
    """A file renamed or removed without its group following would count nothing, silently."""
    head = {path for g in GROUPS for path in g.after}
    assert all((ROOT / path).is_file() for path in head), sorted(
        p for p in head if not (ROOT / p).is_file()
    )
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", ISSUE_TREE],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:  # a clone without the history: only HEAD's side is checkable
        return
    then = set(listed.stdout.split())
    assert {path for g in GROUPS for path in g.before} <= then


def test_the_table_sums_each_side_and_divides_now_by_then() -> None:
    files = {"a.py": {"lines": 10, "logical": 6}, "b.py": {"lines": 5, "logical": 4}}
    saved = {
        "command": ".venv/bin/python bench/line_count.py",
        "machine": {"date": "d", "commit": "c", "machine": "m"},
        "issue_tree": "a" * 40,
        "revision": "b" * 40,
        "groups": [
            {"behaviour": "flow", "before": files, "after": {"c.py": {"lines": 12, "logical": 5}}},
            {"behaviour": "new", "before": {}, "after": {"d.py": {"lines": 3, "logical": 2}}},
        ],
    }
    table = render(saved)
    assert "| flow | 2 | 1 | 15 | 12 | 10 | 5 | 0.50 |" in table
    assert "| new | 0 | 1 | 0 | 3 | 0 | 2 | - |" in table
    assert "| all of them | | | 15 | 15 | 10 | 7 | 0.70 |" in table
