"""The one `relaygr` command: every subcommand the design names answers --help with each
option's default, `relaygr --version` names what it serves, and `relaygr bench` runs the source
tree's benchmarks with their own options."""

import subprocess
import sys

import pytest

from relaygr import __version__
from services.ranker.model import RankingModel
from services.ranker.model_config import PRESETS, ModelPreset
from tooling.cli import COMMANDS
from tooling.local.bench_cli import BENCH_DIR, benchmarks


def relaygr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tooling.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def option_helps(text: str) -> dict[str, str]:
    """Each option's help in a --help text, by its first flag, on one line: argparse starts an
    option at "  -" and indents its continuation lines further."""
    helps: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            helps[current] = line
        elif current is not None and line.startswith("   "):
            helps[current] += " " + line
        else:
            current = None
    return {flag: " ".join(help_text.split()) for flag, help_text in helps.items()}


def test_the_subcommands_tested_are_every_subcommand() -> None:
    assert set(COMMANDS) == {
        "ranker", "router", "trigger", "up", "demo", "simulate", "plan", "loadgen", "bench"
    }  # fmt: skip


@pytest.mark.parametrize(
    "command",
    [[name] for name in COMMANDS] + [["bench", name] for name in benchmarks()],
    ids=" ".join,
)
def test_every_subcommand_documents_each_options_default(command: list[str]) -> None:
    done = relaygr(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:"), done.stdout
    helps = option_helps(done.stdout)
    assert helps, done.stdout
    undocumented = [h for flag, h in helps.items() if flag != "-h" and "default" not in h]
    assert not undocumented, "\n".join(undocumented)


@pytest.mark.parametrize(
    ("command", "flag", "range_"),
    [
        ("router", "--load-epsilon", "(> 0; default: 0.25;"),
        ("router", "--rank-hedge-ms", "(>= 0, 0: never; default: 0;"),
        ("ranker", "--threads", "(>= 0, 0: auto; default: 0;"),
        ("ranker", "--dram-budget-mb", "(>= 0, 0: no host tier; default: 8192.0;"),
        ("ranker", "--metrics-port", "(in [0, 65535], 0: none; default: 0;"),
        ("trigger", "--relay-budget-share", "(in (0, 1]; default: 0.9;"),
        ("trigger", "--margin-ms", "below slo_ms (>= 0; default: 5.0;"),
        ("up", "--rankers", "(>= 1; default: 2)"),
        ("demo", "--rate", "(> 0)"),
    ],
)
def test_options_with_a_valid_range_state_it(command: str, flag: str, range_: str) -> None:
    done = relaygr(command, "--help")
    assert range_ in option_helps(done.stdout)[flag]


def test_an_option_out_of_range_is_refused_in_the_words_of_its_help() -> None:
    done = relaygr("router", "--load-epsilon", "0", "--plaintext")
    assert done.returncode == 2
    assert "router load_epsilon must be > 0, got 0.0" in done.stderr


def test_version_names_the_package_the_contract_and_the_default_model() -> None:
    done = relaygr("--version")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"relaygr {__version__}"
    assert lines[1] == "contract relaygr.v1"
    default_model = RankingModel(PRESETS[ModelPreset.DEFAULT], seed=0)
    assert lines[2].startswith(f"model {default_model.model_version} ")


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
