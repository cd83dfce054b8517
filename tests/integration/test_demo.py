"""`relaygr demo` runs end to end as `make demo` runs it, in CI's time budget."""

import subprocess
import sys
from pathlib import Path


def test_quick_demo_runs_the_mesh_and_reports_both_phases(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "relaygr.cli", "demo", "--quick", "--duration", "6",
         "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    rows = {
        line.split()[0]: line.split() for line in lines if line.startswith(("no relay", "relay "))
    }
    assert set(rows) == {"no", "relay"}, result.stdout
    assert any(line.startswith("relay admissions: ") and "admitted" in line for line in lines)
    assert "failed Ranks: none" in result.stdout
    chart = tmp_path / "relay_demo.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "relay_demo.json").is_file()
    assert "every process it started has exited" in result.stdout
