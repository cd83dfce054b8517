"""`relaygr up`'s LocalMesh: real processes, a relay end to end, nothing left behind; `relaygr
up` itself lists its processes, and one ranker killed by its pid leaves the rest serving."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relaygr.cpu_quota import available_cpus
from relaygr.v1 import ranker_pb2, ranker_pb2_grpc, router_pb2_grpc, trigger_pb2_grpc
from relaygr.wire import rank_request_to_proto
from tests.integration.process_mesh import free_ports, mesh_workdirs, tiny_mesh
from tests.integration.ranker_harness import reply_scores
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input, rel_err
from tooling.local.drive import retrieval_event
from tooling.local.mesh import PROCESSES_FILE, LocalMesh, MeshSpec, ProcessEntry


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _listening_hosts(port: int) -> set[str]:
    """The IPv4 addresses a TCP socket listens on at `port` ("::" for any IPv6 one)."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                ipv4 = len(address) == 8
                hosts.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]) if ipv4 else "::")
    return hosts


def test_mesh_relays_end_to_end_and_leaves_nothing_behind(
    rng: np.random.Generator, private_tempdir: Path
) -> None:
    before = mesh_workdirs()
    # Everything is at risk.
    spec, model = tiny_mesh(trigger_args=("--slo-ms", "2", "--margin-ms", "1"))
    with LocalMesh(spec) as mesh:
        assert mesh.trigger is not None and mesh.router is not None
        pids = [s.process.pid for s in (*mesh.rankers, mesh.router, mesh.trigger)]
        request = rank_input(rng, prefix(rng, 300, user_id="alice"), 16, 8)
        with grpc.insecure_channel(mesh.trigger.address) as channel:
            decision = trigger_pb2_grpc.TriggerServiceStub(channel).OnRetrieval(
                retrieval_event(request, "r1"), timeout=10
            )
        assert decision.admitted, decision
        target = next(s for s in mesh.rankers if s.name == decision.target_instance)
        with grpc.insecure_channel(target.address) as channel:
            ranker = ranker_pb2_grpc.RankerServiceStub(channel)
            describe = ranker_pb2.DescribeRequest()
            pinned = lambda: ranker.Describe(describe).hbm.pinned_bytes > 0  # noqa: E731
            asyncio.run(eventually(pinned, "the relay pinned on its ranker", timeout_s=30))
            # Two rankers split this process's CPUs (tiny_mesh passes no --threads).
            assert mesh.ranker_threads == max(1, available_cpus() // 2)
            assert ranker.Describe(describe).intra_op_threads == mesh.ranker_threads
        with grpc.insecure_channel(mesh.router.address) as channel:
            reply = router_pb2_grpc.RouterServiceStub(channel).Rank(
                rank_request_to_proto(request), timeout=30
            )
        assert reply.instance_id == decision.target_instance
        assert reply.cache_outcome == 1  # CACHE_OUTCOME_HBM_HIT
        expected = model.full_forward(request).numpy()
        scores = reply_scores(reply)
        assert rel_err(scores, expected) <= 1e-5
    assert not any(_alive(pid) for pid in pids)
    assert mesh_workdirs() == before


def test_a_child_dying_during_start_up_stops_everything(private_tempdir: Path) -> None:
    before = mesh_workdirs()
    mesh = LocalMesh(MeshSpec(rankers=2, ranker_args=("--hbm-budget-mb", "-1")))
    with pytest.raises(RuntimeError, match="ranker-0 exited") as err:
        mesh.start()
    assert "hbm_budget_mb must be > 0" in str(err.value)  # the child's own words
    assert mesh.etcd is None and not any(_alive(s.process.pid) for s in mesh.rankers)
    assert mesh_workdirs() == before


def test_relaygr_up_lists_its_pids_and_a_killed_ranker_leaves_the_rest_serving(
    rng: np.random.Generator, private_tempdir: Path
) -> None:
    before = mesh_workdirs()
    metrics_base = free_ports(4)
    up = subprocess.Popen(
        [sys.executable, "-m", "tooling.cli", "up", "--rankers", "2", "--model", "tiny",
         "--ranker-arg", "--device=cpu", "--ranker-arg", "--calibration-lengths=32,64",
         "--metrics-base-port", str(metrics_base)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        listed: list[Path] = []

        def written() -> bool:
            assert up.poll() is None, f"relaygr up exited:\n{up.communicate()[0]}"
            listed[:] = private_tempdir.glob(f"relaygr-mesh-*/{PROCESSES_FILE}")
            return bool(listed)

        asyncio.run(eventually(written, "relaygr up wrote its processes file", timeout_s=300))
        entries = {e["name"]: ProcessEntry(**e) for e in json.loads(listed[0].read_text())}
        assert list(entries) == ["etcd", "ranker-0", "ranker-1", "router", "trigger"]
        assert [e.role for e in entries.values()] == [
            "etcd",
            "ranker",
            "ranker",
            "router",
            "trigger",
        ]
        assert all(_alive(e.pid) for e in entries.values())
        services = [e for e in entries.values() if e.role != "etcd"]
        for offset, entry in enumerate(services):
            port = metrics_base + offset
            assert entry.metrics == f"http://127.0.0.1:{port}/metrics"
            assert _listening_hosts(port) == {"127.0.0.1"}, entry.name

        killed = entries["ranker-0"]
        os.kill(killed.pid, signal.SIGKILL)
        asyncio.run(eventually(lambda: not _alive(killed.pid), "ranker-0 died", timeout_s=30))
        survivors = [e for e in services if e is not killed]
        serving = lambda: all(_serving(e.address) for e in survivors)  # noqa: E731
        asyncio.run(eventually(serving, "the other services serving", timeout_s=30))
        assert _alive(entries["etcd"].pid)
        with grpc.insecure_channel(entries["ranker-1"].address) as channel:
            info = ranker_pb2_grpc.RankerServiceStub(channel).Describe(
                ranker_pb2.DescribeRequest(), timeout=10
            )
        assert info.instance_id == "ranker-1"
        request = rank_request_to_proto(rank_input(rng, prefix(rng, 200), 8, 8))
        with grpc.insecure_channel(entries["router"].address) as channel:
            reply = router_pb2_grpc.RouterServiceStub(channel).Rank(request, timeout=30)
        assert reply.instance_id == "ranker-1"  # the dead one's users fall to the next
    finally:
        up.send_signal(signal.SIGTERM)
        output = up.communicate(timeout=120)[0]
    assert up.returncode == 0, output
    for entry in entries.values():
        assert f"{entry.name:<8} {entry.address:<15}  pid {entry.pid}" in output, output
        assert not _alive(entry.pid)
    assert str(listed[0]) in output
    assert mesh_workdirs() == before


def test_relaygr_up_reaps_a_ranker_stopped_by_sigterm_and_prints_its_exit(
    private_tempdir: Path, tmp_path: Path
) -> None:
    printed = tmp_path / "up.out"
    with printed.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "tooling.cli", "up", "--rankers", "2", "--model", "tiny",
             "--ranker-arg", "--device=cpu", "--ranker-arg", "--calibration-lengths=32,64"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        listed: list[Path] = []

        def written() -> bool:
            assert up.poll() is None, f"relaygr up exited:\n{printed.read_text()}"
            listed[:] = private_tempdir.glob(f"relaygr-mesh-*/{PROCESSES_FILE}")
            return bool(listed)

        asyncio.run(eventually(written, "relaygr up wrote its processes file", timeout_s=300))
        entries = {e["name"]: ProcessEntry(**e) for e in json.loads(listed[0].read_text())}
        assert all(e.running and e.exit_code is None for e in entries.values())
        stopped = entries["ranker-0"]
        assert stopped.pid is not None
        os.kill(stopped.pid, signal.SIGTERM)  # drains, deregisters, exits 0

        def reaped() -> bool:  # gone from /proc: neither running nor a zombie
            return not Path(f"/proc/{stopped.pid}/status").exists()

        asyncio.run(eventually(reaped, "the stopped ranker reaped", timeout_s=60))
        line = f"ranker-0 (pid {stopped.pid}) exited with code 0"
        asyncio.run(eventually(lambda: line in printed.read_text(), "its exit printed"))
        after = {e["name"]: ProcessEntry(**e) for e in json.loads(listed[0].read_text())}
        assert (after["ranker-0"].running, after["ranker-0"].exit_code) == (False, 0)
        assert all(e.running for name, e in after.items() if name != "ranker-0")
        assert _serving(entries["ranker-1"].address)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
    assert up.returncode == 0, printed.read_text()
