"""What tracing costs a Rank: P50/P99 with tracing off, on at 100% and at 1% sampling.

Three `relaygr ranker` processes with the same model and seed, differing only in their OTEL_*
environment: none (off), the OTLP endpoint with the default parent-based always-on sampler
(100%: every Rank is a root here, so every one is traced), and `parentbased_traceidratio` at
0.01 (1%). Their spans go to an OTLP/gRPC receiver in this process, which counts them. Each
user is pre-inferred once on every ranker; then Ranks (all HBM hits, each linked to its
PreInfer span when both are sampled) go to the three rankers one at a time in rotating order,
so drift on a shared machine hits all three alike.

    .venv/bin/python bench/tracing_bench.py            # 1,500 Ranks per mode, ~3 minutes
    .venv/bin/python bench/tracing_bench.py --ranks 200 --no-docs   # smoke run
"""

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.pipeline import BENCH_MODEL, ROOT
from bench.report import (
    add_render_arguments,
    machine_info,
    publish,
    reproduce_command,
    reproduce_lines,
    run_stamp,
)
from relaygr.behaviours import Behaviours, Prefix, RankInput, UserId
from relaygr.cli_help import HelpFormatter
from relaygr.v1 import common_pb2, ranker_pb2_grpc
from relaygr.wire import pre_infer_request_to_proto, rank_request_to_proto
from services.ranker.synthetic import random_behaviours

MODES = ("off", "100%", "1%")


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that counts the spans each service name sends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, int] = {}

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            name = next(
                (a.value.string_value for a in resource_spans.resource.attributes
                 if a.key == "service.name"),
                "",
            )  # fmt: skip
            count = sum(len(scope.spans) for scope in resource_spans.scope_spans)
            with self.lock:
                self.spans[name] = self.spans.get(name, 0) + count
        return trace_service_pb2.ExportTraceServiceResponse()


class Ranker:
    """One `relaygr ranker` process, its output drained by a thread (it logs JSON lines)."""

    def __init__(self, mode: str, model_config: Path, env: dict[str, str], hbm_mb: int) -> None:
        args = [
            sys.executable, "-m", "tooling.cli", "ranker", "--listen", "127.0.0.1:0",
            "--plaintext", "--model-config", str(model_config), "--device", "cpu",
            "--instance-id", f"ranker-{mode}", "--hbm-budget-mb", str(hbm_mb),
            "--calibration-lengths", "256,1024", "--relay-window-ms", "600000",
            "--max-relay-window-ms", "600000",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self.port = self._wait_port(mode)
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_port(self, mode: str) -> int:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if match := re.search(r"listening on port (\d+)", line):
                return int(match.group(1))
        raise RuntimeError(f"ranker {mode} exited:\n{''.join(self.lines[-20:])}")

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def stop(self) -> None:
        self.process.terminate()  # drains, then flushes the spans still batched
        self.process.wait(timeout=60)


def environments(endpoint: str) -> dict[str, dict[str, str]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    on = {**base, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    return {
        "off": base,
        "100%": on,
        "1%": {
            **on,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.01",
        },
    }


def requests(rng: np.random.Generator, users: int, args: argparse.Namespace) -> list[RankInput]:
    def behaviours(n: int, start: int) -> Behaviours:
        return random_behaviours(rng, n, start, 100_000)

    return [
        RankInput(
            Prefix(
                UserId(f"user-{u}"),
                rng.integers(0, 1 << 30, 8),
                behaviours(args.prefix, 1_600_000_000),
            ),
            behaviours(32, 1_700_000_000),
            rng.integers(0, 1 << 40, args.candidates),
            1_700_200_000,
        )
        for u in range(users)
    ]


async def measure(ports: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    users = requests(rng, args.users, args)
    channels = {m: grpc.aio.insecure_channel(f"127.0.0.1:{p}") for m, p in ports.items()}
    try:
        stubs = {m: ranker_pb2_grpc.RankerServiceStub(c) for m, c in channels.items()}
        for q in users:
            for stub in stubs.values():
                await stub.PreInfer(pre_infer_request_to_proto(q.prefix), timeout=60)
        protos = [rank_request_to_proto(q) for q in users]
        for proto in protos[: args.warmup]:
            for stub in stubs.values():
                await stub.Rank(proto, timeout=60)
        client: dict[str, list[float]] = {m: [] for m in MODES}
        server: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.ranks):
            proto = protos[i % len(protos)]
            for mode in MODES[i % 3 :] + MODES[: i % 3]:  # rotate who goes first
                start = time.perf_counter()
                reply = await stubs[mode].Rank(proto, timeout=60)
                client[mode].append((time.perf_counter() - start) * 1e3)
                server[mode].append(reply.server_ms)
                if reply.cache_outcome != common_pb2.CACHE_OUTCOME_HBM_HIT:
                    raise RuntimeError(f"{mode}: expected HBM hits, got {reply.cache_outcome}")
    finally:
        for channel in channels.values():
            await channel.close()
    return {"client": client, "server": server}


def percentiles(values: list[float]) -> dict[str, float]:
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def paired_delta_ms(times: dict[str, list[float]], mode: str) -> float:
    """Median over rounds of (mode - off) for the same request in the same round: the
    systematic cost, much less noisy than a difference of two tails."""
    return float(np.median(np.asarray(times[mode]) - np.asarray(times["off"])))


def render(saved: dict[str, Any]) -> str:
    args = argparse.Namespace(**saved["args"])
    info, stats, spans = saved["machine"], saved["stats"], saved["spans"]
    off = stats["off"]["client"]
    rows = []
    for mode in MODES:
        c, s = stats[mode]["client"], stats[mode]["server"]
        over = (
            ("-", "-", "-")
            if mode == "off"
            else (
                *(f"{(c[q] / off[q] - 1) * 100:+.1f}%" for q in ("p50", "p99")),
                f"{stats[mode]['paired_delta_ms']:+.3f}",
            )
        )
        rows.append(
            f"| {mode} | {c['p50']:.2f} | {c['p99']:.2f} | {over[0]} | {over[1]} | {over[2]} | "
            f"{s['p50']:.2f} | {s['p99']:.2f} | {spans.get(mode, 0)} |"
        )
    p99_1 = (stats["1%"]["client"]["p99"] / off["p99"] - 1) * 100
    verdict = "meets" if p99_1 <= 3.0 else "misses"
    load = f"{args.load_before:.2f} at the start, {saved['load_after']:.2f} at the end"
    return "\n".join([
        "## Tracing: what it costs a Rank",
        *reproduce_lines(saved),
        f"- {run_stamp(info)}; torch {info['torch']}, "
        f"Python {info['python']}. 1-minute load average: {load}.",
        f"- Three `relaygr ranker` processes (CPU, {BENCH_MODEL.num_layers} layers, d_model "
        f"{BENCH_MODEL.d_model}, same seed) differing only in OTEL_* variables: none (off); the "
        "OTLP endpoint with the default parent-based always-on sampler (100%: every Rank is a "
        "trace root, so every one is traced); `parentbased_traceidratio` at 0.01 (1%). Spans "
        "go in batches to an OTLP/gRPC receiver in the benchmark process.",
        f"- {args.users} users ({args.prefix} long-term behaviours + 8 user features, 32 "
        f"short-term, {args.candidates} candidates) pre-inferred once on each ranker; then "
        f"{args.ranks} Ranks per mode, one at a time, the three rankers in rotating order, all "
        "HBM hits (each traced Rank links to its PreInfer span). Client: round trip seen by "
        "the caller; server: the ranker's own `server_ms`. Paired: the median over rounds of "
        "this mode's round trip minus tracing-off's for the same request in the same round.",
        "",
        "| tracing | client P50 ms | client P99 ms | P50 overhead | P99 overhead "
        "| paired median ms | server P50 ms | server P99 ms | spans exported |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"P99 overhead at 1% sampling: {p99_1:+.1f}% (target <= 3%: {verdict} it). With "
        "tracing off no interceptor, exporter or span is created at all (tests/integration/"
        "test_observability.py checks there is no exporter thread and nothing is sent).",
    ])  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = machine_info()  # the commit this run measures, stamped before it runs
    args.load_before = os.getloadavg()[0]
    counter = SpanCounter()
    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(counter, receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    rankers: dict[str, Ranker] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_config = Path(tmp) / "model.json"
            model_config.write_text(json.dumps(BENCH_MODEL.to_dict()))
            for mode, env in environments(f"http://127.0.0.1:{port}").items():
                env = {**env, "OTEL_SERVICE_NAME": mode}
                rankers[mode] = Ranker(mode, model_config, env, hbm_mb=1024)
            times = asyncio.run(measure({m: r.port for m, r in rankers.items()}, args))
    finally:
        for ranker in rankers.values():
            ranker.stop()
        receiver.stop(grace=5).wait()
    stats: dict[str, Any] = {
        mode: {side: percentiles(times[side][mode]) for side in ("client", "server")}
        for mode in MODES
    }
    for mode in MODES[1:]:
        stats[mode]["paired_delta_ms"] = paired_delta_ms(times["client"], mode)
    saved = {
        "command": reproduce_command("tracing_bench", args.seed),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": started,
        "load_after": os.getloadavg()[0],
        "stats": stats,
        "spans": dict(counter.spans),
    }
    out = ROOT / "bench" / "results" / "tracing_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(saved, indent=2))
    return saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--ranks", type=int, default=1500, help="timed Ranks per mode")
    parser.add_argument(
        "--users", type=int, default=64, help="distinct users (prefixes) ranked in turn"
    )
    parser.add_argument("--prefix", type=int, default=1024, help="long-term behaviours")
    parser.add_argument("--candidates", type=int, default=64, help="candidates per Rank")
    parser.add_argument("--warmup", type=int, default=30, help="untimed Ranks per mode")
    parser.add_argument(
        "--seed",
        type=int,
        default=int.from_bytes(os.urandom(4), "little"),
        help="workload seed (default: random)",
    )
    add_render_arguments(parser)
    args = parser.parse_args()
    publish(args, run, render, ROOT / "docs" / "benchmarks.md", "tracing_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
