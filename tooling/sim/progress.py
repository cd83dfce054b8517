"""A progress bar on stderr: one line, redrawn in place; silent when stderr is not a terminal
unless asked (then one line per step)."""

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str = "", out: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = label
        self.out = out or sys.stderr
        self.started = time.perf_counter()
        self._tty = self.out.isatty()

    def step(self, what: str = "") -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.started
        left = elapsed / self.done * (self.total - self.done)
        filled = int(30 * self.done / self.total)
        bar = "#" * filled + "." * (30 - filled)
        line = (
            f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.0f} s, "
            f"~{left:.0f} s left {what}"
        )
        if self._tty:
            end = "\n" if self.done >= self.total else ""
            self.out.write("\r" + line[:150].ljust(150) + end)
        else:
            self.out.write(line + "\n")
        self.out.flush()
