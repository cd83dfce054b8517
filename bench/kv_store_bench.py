"""Per-operation cost of the ranker's KV store at 100 and at 10,000 resident entries.

Each sample builds a store whose two tiers are full: N host entries stored one clock second
apart (with a time to live of N seconds, so from then on each second makes exactly one stale)
and N device entries, all of 64 bytes (one small tensor, shared: memory is not the point). Then,
in each of a few rounds, K of each operation are timed back to back through the store's own
API, with an injected clock and garbage collection off:

- get: `get` of a resident device entry (marks it most recently used);
- pin: `put_device` of a resident entry with a relay window (the PreInfer of a resident prefix);
- consume: `consume` of each of those pinned entries (their Rank);
- expire: `expire` with the clock moved to the next host entry's end of life, where one relay
  window (pinned untimed beforehand) also ends: one pin released and one host copy dropped;
- put: `put_device` of a new user's prefix, unpinned: one device entry demoted to the host tier.

Every round leaves N entries in each tier and nothing pinned. The two sizes run side by side,
batch by batch; a repeat is the median over its batches; the table shows the median and range
over repeats, and the ratio of the medians at 10,000 and at 100 entries (target: within 2x),
beside a control: a plain dict lookup of the same keys. `--before REF` measures the store as
it was at git commit REF as well (by default one repeat of one store per size: its operations
scan every entry, so filling a store of 10,000 takes minutes).

    .venv/bin/python bench/kv_store_bench.py                   # about 30 s
    .venv/bin/python bench/kv_store_bench.py --before 5c87527  # and the store at 5c87527, ~5 min
"""

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from bench.report import (
    add_render_arguments,
    comma_ints,
    machine_info,
    publish,
    reproduce_command,
    run_stamp,
)
from relaygr.behaviours import UserId
from relaygr.cli_help import HelpFormatter
from services.ranker import kv_store
from services.ranker.digest import PrefixDigest, PrefixHasher
from services.ranker.prefix_kv import ModelVersion, PrefixKV
from tooling.local.run_stamp import git_output

ROOT = Path(__file__).resolve().parent.parent
SECTION = "kv_store_bench"
OPS = ("put", "get", "pin", "consume", "expire")
CONTROL = "dict lookup (control)"  # not the store: a plain dict of as many keys
ROWS = (*OPS, CONTROL)
TARGET_RATIO = 2.0
ENTRY_BYTES = 64
STEP_S = 1.0  # clock seconds between host entries' stores, so they go stale one at a time
WINDOW_S = 1e9  # the timed pins' relay window: they end by being consumed
VERSION = ModelVersion("bench")
DIGEST = PrefixDigest("0" * 16)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def small_kv() -> PrefixKV:
    """A prefix of ENTRY_BYTES bytes (one byte per token): the store reads only its size."""
    return PrefixKV(
        keys=torch.zeros(1, 1, ENTRY_BYTES, 1, dtype=torch.uint8),
        values=torch.zeros(1, 1, ENTRY_BYTES, 0),
        timestamps=torch.zeros(0, dtype=torch.int64),
        num_user_tokens=0,
        hasher=PrefixHasher.start(np.zeros(0, np.int64)),
        model_version=VERSION,
    )


def load_store(ref: str | None) -> ModuleType:
    """This tree's kv_store module, or the one at git commit `ref`, imported under its own name."""
    if ref is None:
        return kv_store
    source = git_output("show", f"{ref}:services/ranker/kv_store.py")
    path = Path(tempfile.mkdtemp()) / f"kv_store_{ref}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"kv_store_{ref}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed_ns(call: Callable[[Any], object], arguments: list[Any]) -> int:
    """Nanoseconds to call `call` on each of `arguments`, back to back, garbage collection off."""
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for argument in arguments:
            call(argument)
        return time.perf_counter_ns() - start
    finally:
        gc.enable()


@dataclass(slots=True)
class Sample:
    """One store of `size` entries per tier, driven through `rounds` rounds of `batch` ops."""

    module: ModuleType
    size: int
    batch: int
    rounds: int
    rng: np.random.Generator

    def run(self) -> Iterator[tuple[str, float]]:
        """Each timed batch as it is done: (operation, nanoseconds per operation)."""
        m, n, k = self.module, self.size, self.batch
        assert self.rounds * k <= n, "each round expires k of the host entries stored at fill"
        clock, kv = Clock(), small_kv()
        store = m.KVStore(n * ENTRY_BYTES, n * ENTRY_BYTES, n * STEP_S, clock, lambda x: x)
        hbm, dram = m.Tier.HBM, m.Tier.DRAM

        def key(name: str) -> Any:
            return m.CacheKey(UserId(name), VERSION, DIGEST)

        for j in range(n):  # host entry j goes stale at (n + j) * STEP_S
            clock.now = j * STEP_S
            store.put_host(key(f"host-{j}"), kv)
        device = [key(f"device-{j}") for j in range(n)]
        for k_ in device:
            store.put_device(k_, kv, None)
        control = dict.fromkeys(device)  # a plain dict of as many keys: the memory floor
        for r in range(self.rounds):
            resident = [k_ for k_ in device if store.tier_of(k_) is hbm]
            order = self.rng.permutation(len(resident))
            gets = [resident[i] for i in self.rng.choice(len(resident), k)]
            pins = [resident[i] for i in order[:k]]
            expiring = [resident[i] for i in order[k : 2 * k]]
            yield CONTROL, timed_ns(control.get, gets) / k
            yield "get", timed_ns(lambda k_: store.get(k_, hbm), gets) / k
            yield (
                "pin",
                timed_ns(lambda k_: store.put_device(k_, kv, WINDOW_S), pins) / k,
            )
            yield "consume", timed_ns(store.consume, pins) / k
            ends = [(n + r * k + i) * STEP_S for i in range(k)]
            for k_, end in zip(expiring, ends, strict=True):  # untimed: each ends with a host entry
                store.put_device(k_, kv, end - clock.now)
            yield (
                "expire",
                timed_ns(lambda end: self._expire_at(store, clock, end), ends) / k,
            )
            assert store.usage(dram).entries == n - k and store.usage(hbm).pinned_bytes == 0
            fresh = [key(f"user-{r}-{i}") for i in range(k)]
            yield "put", timed_ns(lambda k_: store.put_device(k_, kv, None), fresh) / k
            device += fresh
            assert store.usage(hbm).entries == store.usage(dram).entries == n

    @staticmethod
    def _expire_at(store: Any, clock: Clock, now: float) -> None:
        clock.now = now
        store.expire()


def measure(
    module: ModuleType, args: argparse.Namespace, samples: int, repeats: int
) -> dict[str, Any]:
    """Microseconds per operation: per size, per operation, one median per repeat.

    The sizes run side by side, batch by batch (each batch of one size followed by the same
    batch of the other), so drift in machine load hits both alike.
    """
    rng = np.random.default_rng(args.seed)
    sizes = [str(s) for s in args.sizes]
    per_op: dict[str, dict[str, list[float]]] = {s: {op: [] for op in ROWS} for s in sizes}
    for _ in Sample(module, min(args.sizes), args.batch, args.rounds, rng).run():
        pass  # warm-up
    for repeat in range(repeats):
        batches: dict[str, dict[str, list[float]]] = {s: {op: [] for op in ROWS} for s in sizes}
        for _ in range(samples):
            runs = [Sample(module, s, args.batch, args.rounds, rng).run() for s in args.sizes]
            for steps in zip(*runs, strict=True):
                for size, (op, ns) in zip(sizes, steps, strict=True):
                    batches[size][op].append(ns)
        for size in sizes:
            for op in ROWS:
                per_op[size][op].append(statistics.median(batches[size][op]) / 1e3)
        print(
            f"repeat {repeat + 1}/{repeats}: "
            + "; ".join(
                f"{op} " + "/".join(f"{per_op[s][op][-1]:.2f}" for s in sizes) + " us"
                for op in ROWS
            ),
            flush=True,
        )
    return {"samples": samples, "repeats": repeats, "per_op_us": per_op}


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = machine_info(threads=1)  # the commit this run measures, stamped before it runs
    load_before = os.getloadavg()[0]
    stores = {"after": measure(load_store(None), args, args.samples, args.repeats)}
    if args.before is not None:
        print(f"the store at {args.before}:", flush=True)
        stores["before"] = {
            "ref": args.before,
            **measure(load_store(args.before), args, args.before_samples, args.before_repeats),
        }
    saved = {
        "command": reproduce_command(SECTION, args.seed),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": started,
        "load_average_1m": {"start": load_before, "end": os.getloadavg()[0]},
        "stores": stores,
    }
    out = ROOT / "bench" / "results" / f"{SECTION}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=2) + "\n")
    return saved


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def _ratio(per_op: dict[str, dict[str, list[float]]], small: str, large: str, op: str) -> float:
    return statistics.median(per_op[large][op]) / statistics.median(per_op[small][op])


def render(saved: dict[str, Any]) -> str:
    args = argparse.Namespace(**saved["args"])
    small, large = (str(s) for s in (min(args.sizes), max(args.sizes)))
    after = saved["stores"]["after"]["per_op_us"]
    before = saved["stores"].get("before")
    columns = f"| operation | {int(small):,} entries, us | {int(large):,} entries, us | ratio |"
    rule = "|---|---:|---:|---:|"
    if before is not None:
        columns += f" before: {int(small):,}, us | before: {int(large):,}, us | before: ratio |"
        rule += "---:|---:|---:|"
    rows = []
    for op in ROWS:
        row = f"| {op} | {_spread(after[small][op])} | {_spread(after[large][op])} "
        row += f"| {_ratio(after, small, large, op):.2f}x |"
        if before is not None:
            old = before["per_op_us"]
            row += f" {_spread(old[small][op])} | {_spread(old[large][op])} "
            row += f"| {_ratio(old, small, large, op):.1f}x |"
        rows.append(row)
    ratios = {op: _ratio(after, small, large, op) for op in OPS}
    missed = [op for op, ratio in ratios.items() if ratio > TARGET_RATIO]
    verdict = (
        f"every operation is within the {TARGET_RATIO:.0f}x target (worst: "
        f"{max(ratios, key=ratios.__getitem__)}, {max(ratios.values()):.2f}x)"
        if not missed
        else f"{', '.join(missed)} miss the {TARGET_RATIO:.0f}x target"
    )
    info, load = saved["machine"], saved["load_average_1m"]
    lines = [
        f"## KV store: per-operation cost at {int(small):,} and {int(large):,} resident entries",
        "",
        f"Reproduce: `make bench-kv` (runs `.venv/bin/python bench/{SECTION}.py`); this run: "
        f"`{saved['command']}`.",
        "",
        f"- {run_stamp(info)}; Python {info['python']}; one thread. 1-minute load average: "
        f"{load['start']:.2f} at the start, {load['end']:.2f} at the end.",
        f"- Both tiers full: N device and N host entries of {ENTRY_BYTES} bytes, injected clock, "
        f"garbage collection off while timing. Per sample {args.rounds} rounds of "
        f"{args.batch} of each operation: get (a resident entry), pin (`put_device` of a "
        "resident entry with a relay window), consume (those pins), expire (one relay window "
        "ends and one host entry passes its time to live), put (a new user's prefix: one "
        "demotion). Every round leaves N entries per tier, nothing pinned. The control is no "
        "store operation: `dict.get` of the same keys from a plain dict of N keys, the cost "
        "that a larger working set adds to any lookup on this machine (cache misses).",
        f"- The two sizes run side by side, each batch of {args.batch} at one size followed by "
        "the same batch at the other. Per operation: the median over a repeat's batches "
        f"({saved['stores']['after']['samples']} stores of each size, {args.rounds} rounds "
        f"each), then the median [range] over {args.repeats} repeats; ratio: the median at "
        f"{int(large):,} entries over the median at {int(small):,}.",
        "",
        columns,
        rule,
        *rows,
        "",
        f"With running totals and heaps, {verdict}.",
    ]
    if before is not None:
        worst = max(OPS, key=lambda op: _ratio(before["per_op_us"], small, large, op))
        old_ratio = _ratio(before["per_op_us"], small, large, worst)
        lines[-1] += (
            f" Before: the store at commit {before['ref']} ({before['repeats']} repeat(s) of "
            f"{before['samples']} store(s) of each size: at 10,000 entries filling one takes "
            "minutes) summed pinned bytes, walked both tiers to expire and searched for "
            f"the first unpinned entry on every call, so its cost grew with the entries: {worst} "
            f"{old_ratio:.0f}x slower at {int(large):,} entries than at {int(small):,}."
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--sizes", type=comma_ints, default=[100, 10_000], help="N,N")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per size")
    parser.add_argument("--samples", type=int, default=10, help="stores per repeat")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per store")
    parser.add_argument("--batch", type=int, default=50, help="operations per round")
    parser.add_argument(
        "--before", metavar="REF", help="also measure the store at commit REF (default: none)"
    )
    parser.add_argument("--before-samples", type=int, default=1, help="its stores per repeat")
    parser.add_argument("--before-repeats", type=int, default=1, help="its repeats")
    parser.add_argument(
        "--seed",
        type=int,
        default=int.from_bytes(os.urandom(4), "little"),
        help="workload seed (default: random)",
    )
    add_render_arguments(parser)
    args = parser.parse_args()
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
