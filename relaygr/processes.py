"""Child processes that never outlive their use: stop with a deadline, die with the parent."""

import contextlib
import ctypes
import signal
import subprocess

_PR_SET_PDEATHSIG = 1


def terminate(process: "subprocess.Popen[bytes]", timeout_s: float) -> None:
    """SIGTERM (the service drains), then SIGKILL if it has not exited within `timeout_s`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)


def die_with_parent() -> None:
    """`preexec_fn` for Popen: Linux sends the child SIGTERM when its parent dies, so a killed
    launcher leaves no orphans. A no-op where prctl is unavailable."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
