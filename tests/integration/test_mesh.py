"""`relaygr up`'s LocalMesh: real processes, a relay end to end, nothing left behind."""

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from relaygr.cpu_quota import available_cpus
from relaygr.local.drive import retrieval_event
from relaygr.local.mesh import LocalMesh, MeshSpec
from relaygr.v1 import ranker_pb2, ranker_pb2_grpc, router_pb2_grpc, trigger_pb2_grpc
from relaygr.wire import rank_request_to_proto
from tests.integration.process_mesh import mesh_workdirs, tiny_mesh
from tests.integration.ranker_harness import reply_scores
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input, rel_err


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def test_mesh_relays_end_to_end_and_leaves_nothing_behind(
    tmp_path: Path, rng: np.random.Generator, private_tempdir: Path
) -> None:
    before = mesh_workdirs()
    # Everything is at risk.
    spec, model = tiny_mesh(tmp_path, trigger_args=("--slo-ms", "2", "--margin-ms", "1"))
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
