"""A cached Rank timed warm, as the start-up calibration times it, and after idle, as light
traffic serves it.

`services.ranker.cost_model.measure` times each Rank right after the prefill that made its
prefix, the repeats back to back. A served Rank under light load comes after the ranker sat idle.
Per history length, the same Rank (the benchmark model, 80 short-term behaviours, 128
candidates) is timed `--calls` times with no pause between calls, and as often after each
idle pause of `--gaps-ms`; the median of each run of calls, its first 3 left out, over
`--rounds` rounds that rotate the order of the pauses (the host's drift hits each alike).

    .venv/bin/python bench/idle_rank.py    # about two minutes on 2 cores
"""

import argparse
import statistics
import time

import numpy as np
import torch

from bench.pipeline import BENCH_MODEL, ROOT, save_results
from bench.report import (
    add_run_arguments,
    machine_info,
    parse_run,
    publish,
    reproduce_lines,
    rotated,
    run_stamp,
)
from relaygr.behaviours import Prefix, RankInput, UserId
from services.ranker.model import RankingModel
from services.ranker.prefix_kv import PrefixKV
from services.ranker.synthetic import random_behaviours

NAME = "idle_rank"
SHORT_TERM, CANDIDATES, SKIPPED = 80, 128, 3


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 3000, 6000])
    p.add_argument("--gaps-ms", type=float, nargs="+", default=[10.0, 100.0])
    p.add_argument("--calls", type=int, default=30, help="timed calls per run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_run_arguments(p)
    args = parse_run(p, argv)
    if args.quick:
        args.lengths, args.calls, args.rounds = [500], 6, 1
    return args


def request(rng: np.random.Generator, length: int) -> RankInput:
    cfg = BENCH_MODEL
    prefix = Prefix(
        UserId("idle-rank"),
        np.zeros(0, np.int64),
        random_behaviours(rng, length, 1_700_000_000, 60 * length, cfg.num_actions),
    )
    short = random_behaviours(rng, SHORT_TERM, 1_790_000_000, 60 * SHORT_TERM, cfg.num_actions)
    return RankInput(prefix, short, rng.integers(0, 1 << 40, CANDIDATES), 1_800_000_000)


def timed_run(model: RankingModel, r: RankInput, kv: PrefixKV, gap_s: float, calls: int) -> float:
    """The median of `calls` timed Ranks, each after `gap_s` of sleep, the first few left out."""
    times = []
    for _ in range(calls):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        model.rank(kv, r.short_term, r.candidates, r.request_ts)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[SKIPPED:])


def run(args: argparse.Namespace) -> dict:
    stamp = machine_info()  # the commit this run measures, stamped before it runs
    torch.set_num_threads(args.threads)
    model, rng = RankingModel(BENCH_MODEL), np.random.default_rng(args.seed)
    gaps = [0.0, *args.gaps_ms]
    rows = []
    for round_ in range(args.rounds):
        for length in args.lengths:
            r = request(rng, length)
            kv = model.prefill(r.prefix)
            for gap in rotated(gaps, round_):
                ms = timed_run(model, r, kv, gap / 1e3, args.calls)
                rows.append({"round": round_, "length": length, "gap_ms": gap, "ms": ms})
                print(
                    f"round {round_} length {length:5d} gap {gap:5g} ms: {ms:6.1f} ms", flush=True
                )
    return save_results(NAME, args, {"rows": rows}, stamp, threads=args.threads)


def render(saved: dict) -> str:
    a, rows = saved["args"], saved["rows"]
    gaps = [0.0, *a["gaps_ms"]]

    def cell(values: list[float], unit: str) -> str:
        mid = statistics.median(values)
        return f"{mid:.2f}{unit} [{min(values):.2f}-{max(values):.2f}]"

    head = " | ".join(
        f"after {g:g} ms idle: ms | / back to back" if g else "back to back: ms" for g in gaps
    )
    lines = [
        "## Model: a cached Rank warm and after idle",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. Benchmark model, {a['threads']} intra-op thread(s); "
        f"{SHORT_TERM} short-term behaviours, {CANDIDATES} candidates; per run the median of "
        f"{a['calls']} calls less the first {SKIPPED}; {a['rounds']} rounds: median [range] "
        "over them, ratios paired per round.",
        "",
        f"| history tokens | {head} |",
        "|---:|" + "---:|" * (2 * len(gaps) - 1),
    ]
    for length in a["lengths"]:
        ms = {g: {r["round"]: r["ms"] for r in rows if r["length"] == length and r["gap_ms"] == g}
              for g in gaps}  # fmt: skip
        cells = [cell(list(ms[0.0].values()), "")]
        for g in gaps[1:]:
            ratios = [ms[g][k] / ms[0.0][k] for k in ms[g]]
            cells += [cell(list(ms[g].values()), ""), cell(ratios, "x")]
        lines.append(f"| {length:,} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    publish(parse(), run, render, ROOT / "docs" / "benchmarks.md", NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
