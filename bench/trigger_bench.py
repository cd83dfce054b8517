"""Admission ablation: trigger modes off / all / sequence-aware on the same mesh and workload.

One local mesh (etcd, two `relaygr ranker` processes, router, trigger). For each rate point the
three modes run in turn (the mode is switched through the trigger's live config key), each on
its own copy of the same seeded user population, so every mode sees the identical request
stream and keeps its own warm caches across points. The full pipeline is driven open loop:
retrieval event to the trigger, the Rank to the router one gap later.

    .venv/bin/python bench/trigger_bench.py            # a few minutes
    .venv/bin/python bench/trigger_bench.py --quick    # smoke run
"""

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.pipeline import (
    BENCH_MODEL,
    ROOT,
    Variant,
    add_sweep_arguments,
    ranker_args,
    result_name,
    save_results,
    sweep,
)
from bench.report import load_result, machine_info, max_compliant, run_stamp, write_section
from bench.verdict import p99_ci, ranks_note
from relaygr.behaviours import Prefix, RankInput, UserId
from relaygr.cli_help import HelpFormatter
from relaygr.cluster import MemoryCluster, RankerRecord
from relaygr.v1 import common_pb2
from services.ranker.synthetic import random_behaviours
from services.trigger.config import TriggerConfig
from services.trigger.dispatch import Dispatcher
from services.trigger.policy import AdmissionPolicy, relays_admitted
from services.trigger.service import TriggerServicer
from tooling.local.drive import Point, retrieval_event
from tooling.local.mesh import LocalMesh, MeshSpec
from tooling.local.workload import WorkloadSpec

MODES = ("off", "all", "sequence-aware")


def decision_time(seed: int) -> dict[str, dict[str, float]]:
    """The trigger's own time per OnRetrieval (parse, policy, reply; no transport), in-process,
    for events that are not at risk (no digest computed) and at risk (digest, admission)."""
    cfg = TriggerConfig(slo_ms=1500, margin_ms=1400, prefill_share=1.0, burst_s=1e6, plaintext=True)
    cluster = MemoryCluster()
    record = RankerRecord(
        "ranker-0", "127.0.0.1:1", "v", 1 << 40, 1 << 40, 2312,
        4.3, 0.0257, 2.0e-5, 4.8e-6, 0.05,
    )  # fmt: skip  # the bench model's calibrated cost on this machine
    asyncio.run(cluster.register(record, 10))
    servicer = TriggerServicer(
        AdmissionPolicy(cfg), cluster, cluster, Dispatcher(_never, 1 << 20, 1)
    )
    rng = np.random.default_rng(seed)
    results: dict[str, dict[str, float]] = {}

    async def measure() -> None:
        for label, length in (("1k history, not at risk", 1024), ("8k history, at risk", 8192)):
            times = []
            for i in range(400):
                behaviours = random_behaviours(rng, length, 1_700_000_000, 10**6)
                prefix = Prefix(UserId(f"{label}-{i}"), rng.integers(0, 1 << 40, 8), behaviours)
                request = RankInput(prefix, behaviours.slice(0, 64), np.arange(128), 0)
                event = retrieval_event(request, str(i))
                start = time.perf_counter()
                await servicer.OnRetrieval(event, None)  # type: ignore[arg-type]
                times.append((time.perf_counter() - start) * 1e3)
            results[label] = {
                "p50_ms": float(np.percentile(times, 50)),
                "p99_ms": float(np.percentile(times, 99)),
            }

    asyncio.run(measure())
    return results


async def _never(request: common_pb2.PreInferRequest, timeout_s: float) -> common_pb2.PreInferReply:
    raise AssertionError("the decision-time measurement sends nothing")


def render(
    points: list[Point],
    args: argparse.Namespace,
    info: dict,
    command: str,
    decide: dict[str, dict[str, float]],
) -> str:
    by_mode = {m: [p for p in points if p.label == m] for m in MODES}
    best = {m: max_compliant(ps, args.slo_ms) for m, ps in by_mode.items()}
    rows = [
        "| rate req/s | mode | requests | P50 ms | P99 ms | P99 95% CI ms | errors | hit ratio "
        "| relays/s | relayed tokens/s | decisions |",
        "|---:|---|---:|---:|---:|---|---|---:|---:|---:|---|",
    ]
    for p in sorted(points, key=lambda p: (p.rate, MODES.index(p.label))):
        span = max(p.duration_s, 1e-9)
        relays = relays_admitted(p.reasons) / span
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(p.reasons.items())) or "-"
        errs = ", ".join(f"{k} {v}" for k, v in p.errors.items()) or "-"
        rows.append(
            f"| {p.rate:g} | {p.label} | {p.sent} | {p.p50_ms:.0f} | {p.p99_ms:.0f} "
            f"| {p99_ci(p.latencies_ms)} | {errs} "
            f"| {p.hit_ratio:.0%} | {relays:.1f} | {p.relayed_tokens / span:.0f} | {decisions} |"
        )
    aware = best["sequence-aware"]

    def ratio(other: str) -> str:
        return f"{aware / best[other]:.1f}x" if best[other] else "unbounded"

    m = BENCH_MODEL
    return "\n".join([
        f"## Trigger: admission ablation (off, all, sequence-aware), {args.hbm_mb} MiB device tier",
        "",
        f"Reproduce: `{command}`.",
        "",
        f"- {run_stamp(info)}. One local mesh: etcd, two "
        f"`relaygr ranker` processes (CPU; {m.num_layers} layers, d_model {m.d_model}; device "
        f"tier {args.hbm_mb} MiB each, host tier {4 * args.hbm_mb} MiB), router, trigger.",
        f"- Workload: the ranker benchmark's (Zipf users, log-normal histories to 8k, return "
        f"visits, {args.gap_ms:.0f} ms retrieval-to-ranking gap); per mode its own copy of the "
        "same seeded population. Open-loop Poisson arrivals, "
        f"max({args.duration:g} s, {args.min_requests} requests) per point, first "
        f"{args.warmup:.0%} excluded.",
        f"- SLO: ranking P99 <= {args.slo_ms:.0f} ms from the intended send time, no failures. "
        f"Trigger: at risk when the predicted full inference exceeds {args.slo_ms:.0f} - "
        f"{args.margin_ms:.0f} ms; relays may pin {args.relay_share:.0%} of a device tier and "
        f"take {args.prefill_share:.0%} of a ranker's time in prefill.",
        "",
        *rows,
        "",
        "SLO-compliant throughput: "
        + ", ".join(f"{m} **{best[m]:g} req/s**" for m in MODES)
        + f"; sequence-aware vs off {ratio('off')}, vs all {ratio('all')}"
        + (f" (**{few}**; one seed)." if (few := ranks_note(p.ok for p in points)) else "."),
        "",
        "The trigger's own time per decision (parse, policy, reply; in-process, no transport): "
        + "; ".join(
            f"{k}: P50 {v['p50_ms']:.3f} ms, P99 {v['p99_ms']:.3f} ms" for k, v in decide.items()
        )
        + ".",
    ])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_sweep_arguments(parser, [2, 4, 6, 8, 10, 11, 12])
    parser.add_argument("--hbm-mb", type=int, default=48, help="device tier per ranker")
    parser.add_argument(
        "--relay-share",
        type=float,
        default=0.9,
        help="share of a ranker's device tier relays may pin",
    )
    parser.add_argument(
        "--prefill-share",
        type=float,
        default=0.5,
        help="the trigger's --prefill-share (deprecated there, ignored)",
    )
    args = parser.parse_args()
    if args.from_json is not None:
        saved = load_result(args.from_json)
    else:
        if args.quick:
            args.rates, args.duration, args.min_requests = [2, 6], 8.0, 0
        saved = run(args)
    saved_args = argparse.Namespace(**saved["args"])
    text = render(
        [Point(**p) for p in saved["points"]],
        saved_args,
        saved["machine"],
        saved["command"],
        saved["decision_time"],
    )
    print(text)
    if not args.no_docs and not saved_args.quick:
        name = result_name("trigger_bench", saved_args)
        write_section(ROOT / "docs" / "benchmarks.md", name, text)
    return 0


def run(args: argparse.Namespace) -> dict:
    started = machine_info()  # the commit this run measures, stamped before it runs
    print(f"seed {args.seed}", flush=True)
    decide = decision_time(args.seed)
    print(f"decision time {decide}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = Path(tmp) / "model.json"
        model_path.write_text(json.dumps(BENCH_MODEL.to_dict()))
        mesh_spec = MeshSpec(
            rankers=2,
            ranker_args=ranker_args(model_path, args.hbm_mb),
            trigger_args=(
                "--slo-ms", str(args.slo_ms), "--margin-ms", str(args.margin_ms),
                "--relay-budget-share", str(args.relay_share),
                "--prefill-share", str(args.prefill_share),
                "--expected-gap-ms", str(args.gap_ms),
            ),
        )  # fmt: skip
        with LocalMesh(mesh_spec) as mesh:
            spec = WorkloadSpec(gap_s=args.gap_ms / 1e3)
            points = sweep([Variant(mode, mesh, mode) for mode in MODES], spec, args)
            threads = mesh.ranker_threads
    results = {"decision_time": decide, "points": [p.summary() for p in points]}
    return save_results("trigger_bench", args, results, started, threads)


if __name__ == "__main__":
    sys.exit(main())
