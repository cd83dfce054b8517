"""The `relaygr` command line: one entry point, one subcommand per role."""

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# subcommand -> (module with `main(argv) -> int`, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ranker": ("services.ranker.server", "serve RankerService: prefix KV caches and ranking"),
    "router": ("services.router.server", "serve RouterService: affine placement of relays"),
    "trigger": ("services.trigger.server", "serve TriggerService: which requests to relay"),
    "up": (
        "relaygr.local.mesh",
        "run the local mesh (etcd, rankers, router, trigger) until Ctrl-C",
    ),
    "demo": ("relaygr.local.demo", "the local mesh driven with and without relays, compared"),
    "bench": ("relaygr.local.bench_cli", "run a benchmark from the source tree's bench/"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relaygr", description="RelayGR serving mesh")
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
