"""`relaygr up`: the local mesh (tooling.local.mesh) from the command line, until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from relaygr.bounds import AT_LEAST_ONE, Bound, Bounded
from relaygr.cli_help import HelpFormatter
from services.ranker.model_config import ModelPreset
from tooling.local.mesh import PROCESSES_FILE, LocalMesh, MeshSpec
from tooling.local.ports import free_port_range
from tooling.local.prometheus import INSTALL_HINT, LocalPrometheus, find_prometheus_binary

# Options whose value is a flag of a service: `--ranker-arg --device=cpu` passes `--device=cpu`.
PASS_THROUGH = ("--ranker-arg", "--router-arg", "--trigger-arg")

DESCRIPTION = f"""\
Run etcd, N rankers, a router and a trigger on loopback until Ctrl-C or SIGTERM.

Prints each process's address and pid, and lists them (name, role, address, pid, /metrics URL,
running or not and exit code) in {PROCESSES_FILE} in the mesh's work directory (its path is
printed), so that a script can stop or kill one of them: one that exits is reaped, its exit
printed, and the rest keep serving. Every service, /metrics included, listens on 127.0.0.1 only.
"""


def join_pass_through(argv: Sequence[str], options: Sequence[str] = PASS_THROUGH) -> list[str]:
    """`argv` with each of `options` joined to the token after it (`--ranker-arg --device=cpu`
    as `--ranker-arg=--device=cpu`): argparse would take a value starting with `-` for an option
    of its own and refuse the pair."""
    joined: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        value = next(tokens, None) if token in options else None
        joined.append(token if value is None else f"{token}={value}")
    return joined


def parser() -> argparse.ArgumentParser:
    up = argparse.ArgumentParser(
        prog="relaygr up", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    up.add_argument(
        "--rankers", type=Bounded(int, AT_LEAST_ONE), default=2, metavar="N", help="rankers"
    )
    up.add_argument(
        "--model",
        choices=[preset.value for preset in ModelPreset],
        help="the rankers' model preset (relaygr ranker --model; default: the ranker's own)",
    )
    examples = {"ranker": "--device=cpu", "router": "--rank-hedge-ms=50", "trigger": "--mode=all"}
    for role, example in examples.items():
        up.add_argument(
            f"--{role}-arg",
            action="append",
            default=[],
            metavar="FLAG",
            help=f"one token of every {role}'s command line (relaygr {role} --help), taken as"
            f" given even when it starts with -, repeatable: --{role}-arg {example}, or"
            f" --{role}-arg --flag --{role}-arg VALUE (default: none)",
        )
    up.add_argument(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="keep the services' logs here (default: the work directory, removed on stop)",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS on every hop and to etcd, with a throwaway CA (default: plaintext)",
    )
    up.add_argument(
        "--metrics-base-port",
        type=Bounded(int, Bound(low=0, high=65535, meaning="0: none")),
        default=0,
        metavar="PORT",
        help="serve each service's /metrics on 127.0.0.1, on consecutive ports from this one"
        " in start order (rankers, routers, trigger)",
    )
    up.add_argument(
        "--prometheus",
        action="store_true",
        help="also start a Prometheus on 127.0.0.1 (Debian package prometheus) scraping every"
        " process, with RelayGR's alerts loaded, and print its URL; services get metrics ports"
        " from a free range unless --metrics-base-port sets them (default: off)",
    )
    return up


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(join_pass_through(sys.argv[1:] if argv is None else argv))
    if args.prometheus and find_prometheus_binary() is None:
        print(f"relaygr up --prometheus: {INSTALL_HINT}", file=sys.stderr)
        return 2
    model = ("--model", args.model) if args.model else ()
    metrics_base_port = args.metrics_base_port
    if args.prometheus and not metrics_base_port:
        metrics_base_port = free_port_range(args.rankers + 2)  # rankers, router, trigger
    spec = MeshSpec(
        rankers=args.rankers,
        ranker_args=(*model, *args.ranker_arg),  # a --ranker-arg=--model=X comes last and wins
        router_args=tuple(args.router_arg),
        trigger_args=tuple(args.trigger_arg),
        log_dir=args.log_dir,
        tls=args.tls,
        metrics_base_port=metrics_base_port,
    )
    wait = _until_signal()
    with LocalMesh(spec) as mesh, ExitStack() as stack:
        watched: list[LocalMesh | LocalPrometheus] = [mesh]
        print(f"relaygr mesh up:\n{mesh.describe()}", flush=True)
        if args.prometheus:
            prometheus = stack.enter_context(LocalPrometheus(mesh.processes()))
            watched.append(prometheus)
            print(f"prometheus {prometheus.url}  (alerts: {prometheus.url}/alerts)", flush=True)
        print("Ctrl-C stops it.", flush=True)
        wait(lambda: _report_exits(watched))
    print("relaygr mesh stopped", flush=True)
    return 0


def _report_exits(watched: Sequence[LocalMesh | LocalPrometheus]) -> None:
    """Reap the processes that exited (a ranker stopped with `kill <pid>` drains and exits) and
    say so; the rest keep serving."""
    for owner in watched:
        for gone in owner.reap():
            print(f"{gone.describe()}; the rest keep serving", flush=True)


def _until_signal() -> Callable[[Callable[[], None]], None]:
    """A function that blocks until SIGINT or SIGTERM (installed now, so none is missed),
    calling its argument every tick meanwhile."""
    received: list[int] = []

    def on_signal(signum: int, _: object) -> None:
        received.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)

    def wait(tick: Callable[[], None]) -> None:
        while not received:
            tick()
            time.sleep(0.2)

    return wait


if __name__ == "__main__":
    sys.exit(main())
