"""The coroutine-test plugin runs an `async def` test's body, and nothing passes unrun."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = """
import asyncio

import pytest

loops = []


async def test_a_failing_assertion():
    await asyncio.sleep(0)
    assert 1 == 2, "the async body ran"


@pytest.mark.parametrize("n", [1, 2])
async def test_passes_with_fixtures(n, tmp_path):
    loops.append(asyncio.get_running_loop())
    assert tmp_path.is_dir() and n in (1, 2)


class TestMethods:
    async def test_a_method(self):
        loops.append(asyncio.get_running_loop())


def test_returns_a_coroutine_unawaited():
    async def body():
        pass

    return body()


async def test_an_async_generator():
    yield


def test_each_ran_on_a_fresh_loop_closed_after():
    assert len({id(loop) for loop in loops}) == len(loops) == 3
    assert all(loop.is_closed() for loop in loops)
"""


def outcomes(tmp_path: Path, *plugin: str) -> dict[str, str]:
    """Each test of SAMPLE by name: PASSED or FAILED, in a pytest of its own."""
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *plugin,
         "test_sample.py"],
        cwd=tmp_path,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    found = {}
    for line in result.stdout.splitlines():
        word, _, rest = line.partition(" test_sample.py::")
        if word in ("PASSED", "FAILED") and rest:
            found[rest.split(" - ")[0]] = word
    assert found, result.stdout + result.stderr
    return found


def test_async_bodies_run_and_their_failures_are_reported(tmp_path: Path) -> None:
    assert outcomes(tmp_path, "-p", "tests.asyncio_plugin") == {
        "test_a_failing_assertion": "FAILED",
        "test_passes_with_fixtures[1]": "PASSED",
        "test_passes_with_fixtures[2]": "PASSED",
        "TestMethods::test_a_method": "PASSED",
        "test_returns_a_coroutine_unawaited": "FAILED",
        "test_an_async_generator": "FAILED",
        "test_each_ran_on_a_fresh_loop_closed_after": "PASSED",
    }


def test_without_the_plugin_no_async_test_passes(tmp_path: Path) -> None:
    found = outcomes(tmp_path)
    assert {name for name, word in found.items() if word == "PASSED"} == set()
