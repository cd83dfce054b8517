"""Shared benchmark reporting: machine description, marker-delimited sections of a Markdown doc."""

import os
import platform
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import torch

DOC_TITLE = (
    "# Benchmarks\n\n"
    "Measured performance of RelayGR components; each section holds its latest run.\n"
)


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info(threads: int | None = None) -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()}, {os.cpu_count()} logical CPUs",
        "threads": threads if threads is not None else torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


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


class RatePoint(Protocol):
    rate: float
    p99_ms: float
    errors: dict[str, int]


def max_compliant(points: Iterable[RatePoint], slo_ms: float) -> float:
    """The highest rate below which every measured point met the SLO (P99, no failures)."""
    best = 0.0
    for point in sorted(points, key=lambda p: p.rate):
        if point.errors or point.p99_ms > slo_ms:
            break
        best = point.rate
    return best


def highest_compliant(points: Iterable[RatePoint], slo_ms: float) -> float:
    """The highest rate of any point that met the SLO (ignoring failures at lower rates)."""
    return max((p.rate for p in points if not p.errors and p.p99_ms <= slo_ms), default=0.0)
