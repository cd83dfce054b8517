"""CPU a request costs that grows with the fleet: placement and the trigger's decision.

At 100 and at 1,000 rankers (one model version, every ranker registered with the same device
tier), on one core with garbage collection off, microseconds per call:

- ranking: `relaygr.placement.ranking` of a user not seen before (rendezvous over every ranker),
  over the version's ids as the services pass them (`VersionIndex.serving_ids`: one set a view);
- kept ranking: the same users again (their orders kept, `placement._Orders`);
- decision, room to spare: what the trigger does for a retrieval, its fallback order
  (`services.trigger.policy.fallback_order`, the user's kept ranking) and
  `AdmissionPolicy.decide` (sequence-aware), with 40 GiB tiers: the room does not bind;
- decision, room binds: the same with 1 MiB tiers, where every relay is larger than the room
  and the relay room is judged over the whole order.

Each repeat times `--users` calls of each kind, the fleet sizes side by side; the table shows
the median and range over repeats.

    .venv/bin/python bench/fleet_cost.py   # about 30 s
"""

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.pipeline import ROOT, save_results
from bench.report import (
    add_run_arguments,
    machine_info,
    parse_run,
    publish,
    reproduce_lines,
    run_stamp,
)
from relaygr.cluster import MemoryCluster, RankerRecord
from relaygr.placement import ranking
from relaygr.versions import VersionIndex
from services.trigger.config import Mode, TriggerConfig
from services.trigger.policy import AdmissionPolicy, Event, fallback_order

KINDS = ("ranking", "kept ranking", "decision, room to spare", "decision, room binds")
SPARE_TIER, BINDING_TIER = 40 * 2**30, 2**20
KV_BYTES_PER_TOKEN = 98_304  # the H100 profile's model: 769 MiB at 8,200 tokens
VERSION = "bench"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="rankers")
    p.add_argument("--users", type=int, default=2000, help="calls of each kind per repeat")
    p.add_argument("--repeats", type=int, default=5)
    add_run_arguments(p)
    args = parse_run(p, argv)
    if args.quick:
        args.users, args.repeats = 200, 1
    return args


def fleet(size: int, tier: int) -> dict[str, RankerRecord]:
    cost = (1.0, 1e-3, 1e-7, 1e-6, 0.1)  # fixed, per token, per pair, per candidate key, reload
    return {
        f"ranker-{i}": RankerRecord(
            f"ranker-{i}", f"10.0.0.{i % 250}:50051", VERSION, tier, tier, KV_BYTES_PER_TOKEN, *cost
        )
        for i in range(size)
    }


def per_call_us(call: Callable[[Any], object], arguments: Sequence[Any]) -> float:
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for argument in arguments:
            call(argument)
        return (time.perf_counter_ns() - start) / len(arguments) / 1e3
    finally:
        gc.enable()


def one_repeat(size: int, users: list[str], rng: random.Random) -> dict[str, float]:
    """Microseconds per call of each kind over a fleet of `size`, for these (fresh) users."""
    ids = VersionIndex.of(fleet(size, SPARE_TIER)).serving_ids(VERSION)
    times = {
        "ranking": per_call_us(lambda user: ranking(user, ids), users),
        "kept ranking": per_call_us(lambda user: ranking(user, ids), users),
    }
    for kind, tier in (
        ("decision, room to spare", SPARE_TIER),
        ("decision, room binds", BINDING_TIER),
    ):
        index = VersionIndex.of(fleet(size, tier))
        policy = AdmissionPolicy(
            TriggerConfig(plaintext=True, mode=Mode.SEQUENCE_AWARE, slo_ms=40.0, margin_ms=5.0)
        )
        asks = []
        for i, user in enumerate(users):
            prefix = rng.choice((512, 2048, 8192))
            asks.append((Event(user, prefix, 64, 256, digest_of(i), VERSION), i))
        times[kind] = per_call_us(deciding(policy, index), asks)
    return times


def digest_of(i: int) -> Callable[[], str]:
    """The i-th event's prefix digest, computed on demand as the trigger's events are."""
    return lambda: f"d{i}"


def deciding(policy: AdmissionPolicy, index: VersionIndex) -> Callable[[Any], object]:
    """One decision by `policy` on an (event, index) ask: the event's fallback order over
    `index` (no directory entries), then the decision, as the trigger makes them."""
    directory = MemoryCluster()
    return lambda ask: policy.decide(
        ask[0], fallback_order(ask[0].user_id, VERSION, index, directory), ask[1] * 1e-3
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    stamp = machine_info(threads=1)
    rng = random.Random(args.seed)
    rows = []
    for repeat in range(args.repeats):
        for size in args.sizes:  # side by side, repeat by repeat
            users = [f"user-{repeat}-{size}-{rng.randrange(10**12)}" for _ in range(args.users)]
            for kind, us in one_repeat(size, users, rng).items():
                rows.append({"rankers": size, "repeat": repeat, "kind": kind, "us": us})
                print(f"{size:>6} rankers {kind:>24}: {us:8.1f} us", flush=True)
    return save_results("fleet_cost", args, {"rows": rows}, stamp, threads=1)


def render(saved: dict[str, Any]) -> str:
    a = saved["args"]
    sizes = a["sizes"]
    lines = [
        "## Fleet-wide cost of a request: placement and the trigger's decision",
        *reproduce_lines(saved),
        f"- {run_stamp(saved['machine'])}. One core, garbage collection off; {a['users']:,} "
        f"calls of each kind per repeat, {a['repeats']} repeats, the fleet sizes side by side. "
        "Microseconds per call, median [range] over repeats.",
        "",
        "| per call | " + " | ".join(f"{s:,} rankers" for s in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for kind in KINDS:
        cells = []
        for size in sizes:
            us = [r["us"] for r in saved["rows"] if r["kind"] == kind and r["rankers"] == size]
            cells.append(f"{statistics.median(us):,.1f} [{min(us):,.1f}-{max(us):,.1f}]")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse()
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", "fleet_cost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
