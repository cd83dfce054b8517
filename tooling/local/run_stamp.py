"""Where a measured run ran: date, commit (a dirty tree flagged), machine, threads."""

import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_output(*args: str) -> str:
    """What `git args` prints in this repository (CalledProcessError when it fails): `git show
    REV:PATH` gives a file as it was at a revision."""
    here = Path(__file__).resolve().parent  # inside the repository, wherever it is run from
    done = subprocess.run(
        ["git", *args], cwd=here, capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout


def _git(*args: str) -> str:
    return git_output(*args).strip()


# A copy of the tree sent to another machine (the device tool's) names the commit it was
# copied from here, set by whoever sent it (the copy's own .git, if any, can be stale), and
# says it was copied.
COPIED_COMMIT_ENV = "RELAYGR_COPIED_FROM"


def git_commit() -> str:
    """HEAD of this repository, "-dirty" when the tree has uncommitted changes; in a copied
    tree, "<commit> (copied tree)" from RELAYGR_COPIED_FROM; "unknown" without either."""
    copied = os.environ.get(COPIED_COMMIT_ENV)
    if copied:
        return f"{copied} (copied tree)"
    try:
        head = _git("rev-parse", "HEAD")
        # Results and docs being written (a benchmark saves and renders after each seed) do not
        # make the code dirty.
        # (Pathspecs from the top: git runs in bench/.)
        outputs = (":(top,exclude)bench/results", ":(top,exclude)docs")
        dirty = bool(_git("status", "--porcelain", "--", ":(top)", *outputs))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head


def machine_info(threads: int | None = None) -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "machine": f"{cpu_model()}, {os.cpu_count()} logical CPUs",
        "threads": threads if threads is not None else torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
