"""Does each ranker's published cost model predict its full inference? 3 fresh meshes of 3.

Each start runs a fresh local mesh (`relaygr up`: etcd, 3 rankers, router, trigger) with the
default model and one intra-op thread per ranker; its rankers calibrate at start-up, one at a
time under the host lock. Then, ranker by ranker (the others idle), the benchmark reads the
cost model the ranker publishes (Describe) and times full inference there: Ranks of fresh
users (misses: chunked prefill + rank) sent straight to that ranker at each history length,
rounds interleaving the lengths, median over the repeats of the server-side time (`server_ms`,
no network). Prediction: the published `full_ms(tokens, candidates)`. Target: every ranker x
length x start within 25% of measured. The model the ranker refitted to those very Ranks
(read afterwards) is shown beside it.

    .venv/bin/python bench/cost_model_bench.py   # about 10 minutes on 2 cores
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.report import (
    add_render_arguments,
    comma_ints,
    machine_info,
    publish,
    reproduce_command,
    run_stamp,
)
from relaygr.behaviours import Behaviours, Prefix, RankInput, UserId
from relaygr.cli_help import HelpFormatter
from relaygr.v1 import common_pb2, ranker_pb2, ranker_pb2_grpc
from relaygr.wire import rank_request_to_proto
from services.ranker.synthetic import random_behaviours
from tooling.local.mesh import LocalMesh, MeshSpec

ROOT = Path(__file__).resolve().parent.parent
SECTION = "cost_model_bench"
TARGET = 0.25  # |predicted / measured - 1| at most this


def cost_of(info: ranker_pb2.RankerInfo) -> dict[str, float]:
    c = info.cost_model
    return {
        "fixed_ms": c.fixed_ms, "per_token_ms": c.per_token_ms, "per_pair_ms": c.per_pair_ms,
        "per_candidate_key_ms": c.per_candidate_key_ms, "reload_ms_per_mb": c.reload_ms_per_mb,
        "median_abs_rel_error": c.median_abs_rel_error, "samples": c.samples,
    }  # fmt: skip


def full_ms(cost: dict[str, float], tokens: int, candidates: int) -> float:
    """`relaygr.cost.CostModel.full_ms`, from a result file's coefficients."""
    return (
        cost["fixed_ms"]
        + cost["per_token_ms"] * (tokens + candidates)
        + cost["per_pair_ms"] * tokens * tokens / 2
        + cost["per_candidate_key_ms"] * candidates * tokens
    )


def miss(rng: np.random.Generator, user: str, tokens: int, candidates: int) -> RankInput:
    """A Rank of a user never seen: `tokens` long-term behaviours, no features, no short term."""
    long_term = random_behaviours(rng, tokens, 1_700_000_000, 60 * tokens)
    prefix = Prefix(UserId(user), np.zeros(0, np.int64), long_term)
    items = rng.integers(0, 1 << 40, candidates)
    return RankInput(prefix, Behaviours.empty(), items, 1_800_000_000)


def measure_ranker(
    address: str, args: argparse.Namespace, rng: np.random.Generator, tag: str
) -> dict[str, Any]:
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = ranker_pb2_grpc.RankerServiceStub(ch)
        before = stub.Describe(ranker_pb2.DescribeRequest(), timeout=30)
        server: dict[int, list[float]] = {n: [] for n in args.lengths}
        client: dict[int, list[float]] = {n: [] for n in args.lengths}
        for repeat in range(args.repeats):
            for n in args.lengths:
                request = rank_request_to_proto(
                    miss(rng, f"{tag}-{n}-{repeat}", n, args.candidates)
                )
                start = time.perf_counter()
                reply = stub.Rank(request, timeout=120)
                client[n].append((time.perf_counter() - start) * 1e3)
                server[n].append(reply.server_ms)
                assert reply.cache_outcome == common_pb2.CACHE_OUTCOME_MISS, reply.cache_outcome
        after = stub.Describe(ranker_pb2.DescribeRequest(), timeout=30)
    return {
        "published": cost_of(before),
        "refitted": cost_of(after),
        "threads": before.intra_op_threads,
        "server_ms": {str(n): v for n, v in server.items()},
        "client_ms": {str(n): v for n, v in client.items()},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    saved: dict[str, Any] = {
        "command": reproduce_command("cost_model_bench", args.seed),
        "machine": machine_info(threads=1),
        "lengths": args.lengths,
        "candidates": args.candidates,
        "repeats": args.repeats,
        "load_start": os.getloadavg()[0],
        "starts": [],
    }
    out = ROOT / "bench" / "results" / f"{SECTION}.json"
    for start in range(args.starts):
        began = time.monotonic()
        with LocalMesh(MeshSpec(rankers=3)) as mesh:
            startup_s = time.monotonic() - began
            rankers = {
                s.name: measure_ranker(s.address, args, rng, f"s{start}-{s.name}")
                for s in mesh.rankers
            }
        saved["starts"].append({"startup_s": startup_s, "rankers": rankers})
        print(f"start {start}: mesh up in {startup_s:.0f} s", file=sys.stderr)
        saved["load_end"] = os.getloadavg()[0]
        out.write_text(json.dumps(saved, indent=1))
    return saved


def rows(saved: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for i, start in enumerate(saved["starts"]):
        for name, ranker in start["rankers"].items():
            for n in saved["lengths"]:
                measured = statistics.median(ranker["server_ms"][str(n)])
                predicted = full_ms(ranker["published"], n, saved["candidates"])
                refitted = full_ms(ranker["refitted"], n, saved["candidates"])
                out.append({
                    "start": i + 1, "ranker": name, "tokens": n, "predicted": predicted,
                    "measured": measured, "spread": ranker["server_ms"][str(n)],
                    "client": statistics.median(ranker["client_ms"][str(n)]),
                    "ratio": predicted / measured, "refitted_ratio": refitted / measured,
                })  # fmt: skip
    return out


def render(saved: dict[str, Any]) -> str:
    m = saved["machine"]
    table = rows(saved)
    within = [r for r in table if abs(r["ratio"] - 1) <= TARGET]
    worst = max(table, key=lambda r: abs(r["ratio"] - 1))
    lines = [
        "## Cost model: published prediction vs measured full inference, 3-ranker mesh",
        "",
        f"Reproduce: `.venv/bin/python bench/cost_model_bench.py`; this run: `{saved['command']}`.",
        "",
        f"- {run_stamp(m)}; Python {m.get('python', '?')}; torch {m.get('torch', '?')}. "
        f"1-minute load average: {saved['load_start']:.2f} at the start, "
        f"{saved.get('load_end', 0.0):.2f} at the end.",
        f"- {len(saved['starts'])} fresh starts of a local mesh (etcd, 3 rankers, router, "
        "trigger; default model config, one intra-op thread per ranker). Each ranker calibrates "
        "at start-up under the host-wide lock (default lengths 256-8,192, 3 interleaved "
        "repeats, per-length medians, robust non-negative fit). Then, one ranker at a time, "
        "the model it publishes (Describe) is read and full inference timed there: "
        f"{saved['repeats']} Ranks of fresh users (misses: chunked prefill + rank) per length "
        f"with {saved['candidates']} candidates, lengths interleaved; measured = median "
        "server-side time (`server_ms`). Target: predicted within 25% of measured.",
        "- Mesh start-up (every ranker loaded and calibrated): "
        + ", ".join(f"{s['startup_s']:.0f} s" for s in saved["starts"])
        + ".",
        "",
        "| start | ranker | tokens | predicted ms | measured ms [runs] | client ms | "
        "predicted / measured | within 25% | refitted / measured |",
        "|---:|---|---:|---:|---|---:|---:|---|---:|",
    ]
    for r in table:
        runs = ", ".join(f"{v:.0f}" for v in r["spread"])
        ok = "yes" if abs(r["ratio"] - 1) <= TARGET else "**no**"
        lines.append(
            f"| {r['start']} | {r['ranker']} | {r['tokens']:,} | {r['predicted']:.0f} | "
            f"{r['measured']:.0f} [{runs}] | {r['client']:.0f} | {r['ratio']:.2f} | {ok} | "
            f"{r['refitted_ratio']:.2f} |"
        )
    lines += ["", "Published models (ms; error: median relative error over the fit's samples):", ""]
    lines += [
        "| start | ranker | fixed | per token | per pair | per candidate key | error | samples |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, start in enumerate(saved["starts"]):
        for name, ranker in start["rankers"].items():
            c = ranker["published"]
            lines.append(
                f"| {i + 1} | {name} | {c['fixed_ms']:.2f} | {c['per_token_ms']:.4f} | "
                f"{c['per_pair_ms']:.3g} | {c['per_candidate_key_ms']:.3g} | "
                f"{c['median_abs_rel_error']:.1%} | {c['samples']} |"
            )
    verdict = "met" if len(within) == len(table) else "missed"
    lines += [
        "",
        f"{len(within)} of {len(table)} ranker x length x start predictions within 25% "
        f"(target {verdict}); worst: start {worst['start']} {worst['ranker']} at "
        f"{worst['tokens']:,} tokens, predicted {worst['predicted']:.0f} ms against "
        f"{worst['measured']:.0f} ms measured ({worst['ratio']:.2f}x).",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--starts", type=int, default=3, help="fresh meshes")
    parser.add_argument("--lengths", type=comma_ints, default=[256, 2048, 8192], help="N,N")
    parser.add_argument("--candidates", type=int, default=128, help="candidates per Rank")
    parser.add_argument("--repeats", type=int, default=3, help="Ranks per length per ranker")
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
