r"""`relaygr plan` as a stored result: its answer, the slice check and the printed report, with the
command, machine and commit stamped as the run starts, re-rendered into docs/benchmarks.md.

Every option after `--` goes to `relaygr plan` unchanged; this script adds `--json` and saves
what it wrote to bench/results/plan_bench[_TAG].json.

    .venv/bin/python bench/plan_bench.py --tag quick_h200 -- --profile profiles/nvidia-h200.toml \
        --qps 40 --slo-ms 20 --gap-ms 100 --candidates 256 --duration 10 --seeds 1 2 \
        --slice 2 --check-slice
"""

import argparse
import contextlib
import io
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.pipeline import ROOT
from bench.report import add_render_arguments, dumps_result, publish, reproduce_lines, run_stamp
from relaygr.cli_help import HelpFormatter
from tooling.sim.plan_cli import main as plan_main

NAME = "plan_bench"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--tag", default="", help="suffix of the result file and docs section (default: none)"
    )
    add_render_arguments(p)
    p.add_argument("plan", nargs=argparse.REMAINDER, help="-- then `relaygr plan`'s options")
    args = p.parse_args(argv)
    args.plan = args.plan[1:] if args.plan[:1] == ["--"] else args.plan
    if args.from_json is None and not args.plan:
        p.error("give `relaygr plan`'s options after --")
    return args


def result_name(args: argparse.Namespace) -> str:
    return f"{NAME}_{args.tag}" if args.tag else NAME


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        printed = io.StringIO()
        started = time.perf_counter()
        with contextlib.redirect_stdout(printed):
            code = plan_main([*args.plan, "--json", str(out)])
        wall_s = time.perf_counter() - started
        sys.stdout.write(printed.getvalue())
        if not out.exists():
            raise SystemExit(f"relaygr plan wrote no result (exit {code})")
        # The temporary --json path is no part of what reruns it.
        plan = json.loads(out.read_text().replace(f" --json {out}", ""))
    command = [".venv/bin/python", "bench/plan_bench.py"]
    command += ["--tag", args.tag] if args.tag else []
    saved = {
        # The seeds drawn (if none were given) are in the plan's own command: rerun with those.
        "command": shlex.join([*command, "--", *shlex.split(plan["command"])[2:]]),
        "machine": plan.pop("machine"),  # stamped by `relaygr plan` as it started
        "exit": code,
        "wall_s": wall_s,  # the whole search, with `plan["jobs"]` simulations at once
        "plan": plan,
    }
    path = ROOT / "bench" / "results" / f"{result_name(args)}.json"
    path.write_text(dumps_result(saved))
    return saved


def render(saved: dict) -> str:
    plan = saved["plan"]
    answer = plan["answer"]
    checked = "yes" if plan["slice_check"] else "no (the answer fits the slice, or not asked)"
    found = (
        f"{answer['rankers']} rankers, device tier {answer['device_tier_bytes'] / 2**30:.2f} GiB"
        if answer
        else "no answer within the search's bounds"
    )
    took = (
        f" It took {saved['wall_s']:.0f} s of wall time with {plan['jobs']} simulation(s) at "
        "once (`--jobs`; the answer is the same whatever the count)."
        if "wall_s" in saved
        else ""
    )
    return "\n".join([
        f"## relaygr plan: {plan['profile']}, {plan['qps']:g} req/s within {plan['slo_ms']:g} ms",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. Simulated, not measured: `relaygr plan`'s search "
        f"(variant `{plan['variant']}`); answer: **{found}**; slice checked against the whole "
        f"fleet: {checked}.{took}",
        "",
        "What it printed:",
        "",
        "```",
        plan["report"].rstrip(),
        "```",
    ])  # fmt: skip


def main() -> int:
    args = parse()
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", result_name(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
