"""The one `relaygr` command: every subcommand the design names answers --help, and
`relaygr bench` runs the source tree's benchmarks with their own options."""

import subprocess
import sys

import pytest

from relaygr.local.bench_cli import BENCH_DIR, benchmarks


def relaygr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relaygr.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("command", ["ranker", "router", "trigger", "up", "demo", "bench"])
def test_every_subcommand_documents_its_options(command: str) -> None:
    done = relaygr(command, "--help")
    assert done.returncode == 0, done.stderr
    assert f"relaygr {command}" in done.stdout


def test_bench_lists_every_benchmark_script_by_name() -> None:
    names = set(benchmarks())
    assert {"model", "ranker", "router", "trigger", "relay", "tracing", "chaos"} <= names
    scripts = {p.name for p in BENCH_DIR.glob("*_bench.py")}
    assert {f"{name}_bench.py" for name in names} == scripts


def test_bench_passes_the_options_to_the_benchmark() -> None:
    done = relaygr("bench", "relay", "--help")
    assert done.returncode == 0, done.stderr
    assert "--variants" in done.stdout  # relay_bench.py's own option


def test_bench_refuses_an_unknown_name_listing_the_known_ones() -> None:
    done = relaygr("bench", "nonexistent")
    assert done.returncode == 2
    assert "invalid choice" in done.stderr and "relay" in done.stderr
