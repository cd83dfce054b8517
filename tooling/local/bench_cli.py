"""`relaygr bench NAME [OPTIONS]`: run one of the source tree's benchmarks, bench/NAME_bench.py.

The benchmarks live beside the package in a checkout (they are not installed, nor in the
image); each documents its own options (`relaygr bench NAME --help`).
"""

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from relaygr.cli_help import HelpFormatter

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
SUFFIX = "_bench"


def benchmarks(bench_dir: Path = BENCH_DIR) -> dict[str, Path]:
    """Benchmark name -> script, for every bench/<name>_bench.py."""
    return {p.stem.removesuffix(SUFFIX): p for p in sorted(bench_dir.glob(f"*{SUFFIX}.py"))}


def main(argv: Sequence[str] | None = None) -> int:
    found = benchmarks()
    parser = argparse.ArgumentParser(
        prog="relaygr bench",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("name", choices=sorted(found), help="which benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    if not found:
        parser.error(f"no benchmarks in {BENCH_DIR}: run from a source checkout of RelayGR")
    args = parser.parse_args(argv)
    # Each benchmark is a script importing its siblings (pipeline, report): run it as one.
    return subprocess.call([sys.executable, str(found[args.name]), *args.options])


if __name__ == "__main__":
    sys.exit(main())
