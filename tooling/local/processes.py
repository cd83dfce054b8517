"""Child processes that never outlive their use: stop with a deadline, die with the parent."""

import shutil
import signal
import subprocess


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


def dying_with_parent(args: list[str]) -> list[str]:
    """`args` run so that Linux sends the child SIGTERM when this process dies (no orphans when
    a launcher is killed): through util-linux `setpriv --pdeathsig`, as is where that is absent.

    The signal follows the thread that starts the child: start it from a long-lived thread. Not
    a Popen `preexec_fn`: running Python between fork and exec is unsafe once gRPC threads exist
    (the forked child can abort in gRPC's poller).
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *args] if setpriv else list(args)
