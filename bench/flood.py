"""Memory flood: maximum-size PreInfers sent through a mesh as fast as it takes them, while each
ranker's tier usage (Describe) and process RSS (/proc) are watched against their limits.

A ranker's RSS limit is its RSS after warm-up + its HBM budget + its DRAM budget + a stated
overhead. On a CPU ranker both tiers live in host memory, so the budgets bound what the caches
may add; the overhead covers the rest of a flood's working set: activations of the prefill
chunk in flight, request and reply buffers of the PreInfers in flight, freed memory the
allocator keeps for reuse, and the interpreter's own growth.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from relaygr.authz import Role
from relaygr.behaviours import Prefix, RankInput, UserId
from relaygr.tls import open_channel
from relaygr.v1 import common_pb2, ranker_pb2, ranker_pb2_grpc
from relaygr.wire import pre_infer_request_to_proto, rank_request_to_proto
from services.ranker.synthetic import random_behaviours
from tooling.local.mesh import ROUTER_REPLICAS, LocalMesh
from tooling.local.workload import T0

MIB = 1 << 20
_PRE_INFER = "/relaygr.v1.RouterService/PreInfer"


@dataclass(frozen=True, slots=True)
class FloodSettings:
    duration_s: float = 6.0  # at least this long, and on until every tier has been full
    max_duration_s: float = 60.0  # or until this, on a machine too slow to fill them
    concurrency: int = 8  # PreInfers in flight at once
    # Pins end soon: flood prefixes become evictable, fall to the host tier and out of it.
    relay_window_ms: int = 2000
    poll_s: float = 0.05  # tiers and RSS are read this often
    overhead_mb: float = 128.0  # see the module docstring
    timeout_s: float = 30.0


@dataclass(slots=True)
class RankerWatch:
    """One ranker's limits and what the flood made of them."""

    name: str
    pid: int
    hbm_budget: int
    dram_budget: int
    baseline_rss: int  # after warm-up, before the flood
    limit_rss: int  # baseline + both budgets + overhead
    peak_rss: int = 0
    peak_hbm: int = 0
    peak_dram: int = 0
    polls: int = 0
    violations: list[str] = field(default_factory=list)

    def filled(self, prefix_bytes: int) -> bool:
        """Both tiers have held all but two prefixes' worth of their budgets."""
        return (
            min(self.peak_hbm - self.hbm_budget, self.peak_dram - self.dram_budget)
            > -2 * prefix_bytes
        )


@dataclass(slots=True)
class FloodReport:
    sent: int
    statuses: dict[str, int]  # by gRPC status name
    prefix_tokens: int  # of every flood PreInfer: the most a ranker accepts
    prefix_bytes: int  # what each pins in a tier
    overhead_bytes: int
    rankers: list[RankerWatch]

    def render(self) -> str:
        rows = [
            "| ranker | HBM peak / budget, MiB | DRAM peak / budget, MiB | RSS after warm-up, MiB "
            "| RSS peak, MiB | RSS limit, MiB | polls | violations |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.rankers:
            rows.append(
                f"| {r.name} | {r.peak_hbm / MIB:.1f} / {r.hbm_budget / MIB:.0f} "
                f"| {r.peak_dram / MIB:.1f} / {r.dram_budget / MIB:.0f} "
                f"| {r.baseline_rss / MIB:.0f} | {r.peak_rss / MIB:.0f} | {r.limit_rss / MIB:.0f} "
                f"| {r.polls} | {len(r.violations)} |"
            )
        return "\n".join(rows)


def rss_bytes(pid: int) -> int:
    """The resident set size of process `pid` (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _warm_up_request(rng: np.random.Generator, name: str, features: int) -> RankInput:
    prefix = Prefix(
        UserId(f"flood-warm-up-{name}"),
        rng.integers(0, 1 << 40, features),
        random_behaviours(rng, 64, T0, 10**6),
    )
    return RankInput(
        prefix,
        random_behaviours(rng, 8, T0 + 10**6, 100),
        rng.integers(0, 99, 8),
        T0 + 10**6 + 100,
    )


def memory_flood(mesh: LocalMesh, settings: FloodSettings, rng: np.random.Generator) -> FloodReport:
    return asyncio.run(_flood(mesh, settings, rng))


async def _flood(mesh: LocalMesh, settings: FloodSettings, rng: np.random.Generator) -> FloodReport:
    tls = mesh.client_tls
    # Rankers are called directly, as a router calls them (under TLS: a router's identity).
    as_router = mesh.tls_as(Role.ROUTER, "flood")
    channels = {s.name: open_channel(s.address, as_router) for s in mesh.rankers}
    routers = open_channel(mesh.router_target, tls, ROUTER_REPLICAS)
    try:
        stubs = {name: ranker_pb2_grpc.RankerServiceStub(c) for name, c in channels.items()}
        describe = ranker_pb2.DescribeRequest()
        infos = {name: await stub.Describe(describe, timeout=10) for name, stub in stubs.items()}
        dims = next(iter(infos.values())).dims
        # Warm-up: each ranker has served a Rank (threads, allocator, code paths are up).
        for name, stub in stubs.items():
            request = _warm_up_request(rng, name, dims.max_user_features)
            await stub.Rank(rank_request_to_proto(request), timeout=settings.timeout_s)
        overhead = int(settings.overhead_mb * MIB)
        watches = []
        for service in mesh.rankers:
            info = infos[service.name]
            baseline = rss_bytes(service.process.pid)
            limit = baseline + info.hbm.budget_bytes + info.dram.budget_bytes + overhead
            watch = RankerWatch(
                service.name,
                service.process.pid,
                info.hbm.budget_bytes,
                info.dram.budget_bytes,
                baseline_rss=baseline,
                limit_rss=limit,
            )
            watches.append(watch)
        # The largest prefix a ranker accepts: every user feature, the rest behaviours.
        features = dims.max_user_features
        behaviours = dims.max_history_tokens - features
        template = pre_infer_request_to_proto(
            Prefix(
                UserId("x"),
                rng.integers(0, 1 << 40, features),
                random_behaviours(rng, behaviours, T0, 10**7),
            ),
            relay_window_ms=settings.relay_window_ms,
        )
        template.ClearField("user_id")
        body = template.SerializeToString()
        statuses: Counter[str] = Counter()
        users = itertools.count()
        start = time.monotonic()
        prefix_bytes = dims.max_history_tokens * dims.cache_bytes_per_token
        pre_infer = routers.unary_unary(_PRE_INFER)  # bytes in, bytes out

        def flooding() -> bool:
            # A fixed duration proves nothing on a loaded machine that fills no tier in it.
            elapsed = time.monotonic() - start
            filled = all(w.filled(prefix_bytes) for w in watches)
            return elapsed < settings.max_duration_s and (
                elapsed < settings.duration_s or not filled
            )

        async def worker() -> None:
            while flooding():
                # Serialized messages concatenate as a merge: the template plus this user.
                user = common_pb2.PreInferRequest(user_id=f"flood-{next(users)}")
                try:
                    await pre_infer(body + user.SerializeToString(), timeout=settings.timeout_s)
                except grpc.aio.AioRpcError as err:
                    statuses[err.code().name] += 1
                else:
                    statuses["OK"] += 1

        async def poll(watch: RankerWatch) -> None:
            info = await stubs[watch.name].Describe(describe, timeout=10)
            rss = rss_bytes(watch.pid)
            watch.polls += 1
            watch.peak_rss = max(watch.peak_rss, rss)
            watch.peak_hbm = max(watch.peak_hbm, info.hbm.used_bytes)
            watch.peak_dram = max(watch.peak_dram, info.dram.used_bytes)
            for tier, usage in (("hbm", info.hbm), ("dram", info.dram)):
                if usage.used_bytes > usage.budget_bytes or usage.pinned_bytes > usage.used_bytes:
                    watch.violations.append(f"{tier} {usage}".replace("\n", " "))
            if rss > watch.limit_rss:
                watch.violations.append(f"RSS {rss / MIB:.0f} MiB > {watch.limit_rss / MIB:.0f}")

        async def watch_all() -> None:
            while flooding():
                await asyncio.gather(*(poll(w) for w in watches))
                await asyncio.sleep(settings.poll_s)

        await asyncio.gather(watch_all(), *(worker() for _ in range(settings.concurrency)))
        await asyncio.gather(*(poll(w) for w in watches))  # after the last PreInfer landed
        return FloodReport(
            sent=sum(statuses.values()),
            statuses=dict(statuses),
            prefix_tokens=dims.max_history_tokens,
            prefix_bytes=prefix_bytes,
            overhead_bytes=overhead,
            rankers=watches,
        )
    finally:
        await routers.close()
        for channel in channels.values():
            await channel.close()
