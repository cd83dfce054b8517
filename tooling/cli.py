"""The `relaygr` command line: one entry point, one subcommand per role."""

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from relaygr.cli_help import HelpFormatter

# subcommand -> (module with `main(argv) -> int`, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ranker": ("services.ranker.server", "serve RankerService: prefix KV caches and ranking"),
    "router": ("services.router.server", "serve RouterService: affine placement of relays"),
    "trigger": ("services.trigger.server", "serve TriggerService: which requests to relay"),
    "up": (
        "tooling.local.up",
        "run the local mesh (etcd, rankers, router, trigger) until Ctrl-C",
    ),
    "demo": ("tooling.local.demo", "the local mesh driven with and without relays, compared"),
    "simulate": (
        "tooling.sim.simulate",
        "simulate a fleet on a virtual clock with a device profile (the services' own policies)",
    ),
    "plan": (
        "tooling.sim.plan_cli",
        "how many rankers, and how much device and host memory each, meet a P99 SLO (simulated)",
    ),
    "loadgen": (
        "tooling.local.loadgen",
        "MLPerf LoadGen's Server scenario on the mesh: the highest valid QPS of each system",
    ),
    "bench": ("tooling.local.bench_cli", "run a benchmark from the source tree's bench/"),
}


def version_text() -> str:
    """The package's version, the gRPC contract's (its proto package) and the model_version a
    ranker reports when nothing chooses its model (built here as the ranker builds it)."""
    from relaygr import __version__
    from relaygr.v1 import ranker_pb2
    from services.ranker.config import RankerConfig
    from services.ranker.server import load_model

    ranker = RankerConfig(plaintext=True, device="cpu")
    model = load_model(ranker)
    return (
        f"relaygr {__version__}\n"
        f"contract {ranker_pb2.DESCRIPTOR.package}\n"
        f"model {model.model_version} (a ranker's default: --model {ranker.model.value},"
        f" --model-seed {ranker.model_seed}, no checkpoint)"
    )


class _Version(argparse.Action):
    """`--version`: prints `version_text()`, computed only when asked, and exits."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version_text(), flush=True)
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relaygr", description="RelayGR serving mesh", formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--version",
        action=_Version,
        help="print the package, contract (relaygr.v1) and default model versions, and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, text) in COMMANDS.items():
        # Each subcommand parses its own options (and --help) in its module.
        commands.add_parser(name, help=text, add_help=False)
    args, rest = parser.parse_known_args(argv)
    module, _ = COMMANDS[args.command]
    run: Callable[[Sequence[str]], int] = importlib.import_module(module).main
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
