"""`relaygr demo` runs end to end as `make demo` runs it, in CI's time budget."""

import json
import subprocess
import sys
from pathlib import Path


def test_quick_demo_runs_the_mesh_and_reports_both_phases(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tooling.cli", "demo", "--quick", "--duration", "6",
         "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    rows = {
        label: line.split()
        for line in lines
        for label in ("cache only", "relay", "no cache")
        if line.startswith(label + " ") and "admissions" not in line
    }
    assert set(rows) == {"cache only", "relay", "no cache"}, result.stdout
    # Every row reports P99 against the SLO and the split of where prefixes came from.
    assert all(row[-4] in ("within", "OVER") for row in rows.values()), result.stdout
    assert rows["no cache"][-3:] == ["0%", "0%", "100%"], result.stdout  # bypass: all full
    assert rows["cache only"][-3] == "0%", result.stdout  # nothing relayed without a trigger
    assert rows["relay"][-3] != "0%", result.stdout  # the relay relayed something
    assert "in-SLO" not in result.stdout  # no per-rate throughput that reads as equal
    relay_line = next(line for line in lines if line.startswith("relay admissions: "))
    assert "admitted" in relay_line or "spare" in relay_line, relay_line  # it relayed some
    assert result.stdout.count("failed Ranks: none") == 3, result.stdout
    chart = tmp_path / "relay_demo.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "relay_demo.json").read_text())
    assert [p["label"] for p in saved["points"]] == ["cache only", "relay", "no cache"]
    assert "every process it started has exited" in result.stdout
    # Not a terminal: progress is a plain line at each quarter of a phase, never a redraw.
    assert "\r" not in result.stderr
    for label in ("cache only", "relay", "no cache"):
        lines = [line for line in result.stderr.splitlines() if line.startswith(f"  {label} ")]
        assert 1 <= len(lines) <= 4, result.stderr
        done, total = lines[-1].split()[-1].split("/")
        assert done == total, result.stderr


def test_a_chart_with_no_answered_rank_is_not_drawn(tmp_path: Path) -> None:
    from tooling.local.demo import chart
    from tooling.local.drive import Point

    assert not chart([Point("relay", 1.0), Point("cache only", 1.0)], 250.0, tmp_path / "c.png")
    assert not (tmp_path / "c.png").exists()
