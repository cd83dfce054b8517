"""The `relaygr` command line: one entry point, one subcommand per role."""

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relaygr", description="RelayGR serving mesh")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "demo", help="in-process relay demo: pre-infer, rank, compare", add_help=False
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from relaygr import demo

        return demo.main(rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
