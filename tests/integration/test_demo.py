"""`relaygr demo` runs end to end as a user runs it, and reports an exact relay."""

import subprocess
import sys


def test_quick_demo_prints_an_exact_comparison() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "relaygr.cli",
            "demo",
            "--quick",
            "--repeats",
            "1",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line[:7].strip().isdigit()]
    assert [row[0] for row in rows] == ["520", "2056"]
    for row in rows:
        assert float(row[-1]) <= 1e-5  # max relative error of cached vs full scores
