"""A lock held across the processes of one host: rankers sharing cores calibrate one at a time."""

import fcntl
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CALIBRATION_LOCK = "relaygr-calibration.lock"


@contextmanager
def host_lock(directory: Path | None = None, name: str = CALIBRATION_LOCK) -> Iterator[Path]:
    """Hold an exclusive `flock` on `directory/name` (default: the temporary directory).

    Blocks until no other holder has it: any process or thread of this host that opened the
    same file (each `open` is its own lock owner). The kernel drops the lock when its holder
    exits, however it exits, so a killed ranker never leaves the others waiting. Yields the
    lock file's path.
    """
    folder = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with path.open("a") as file:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)
