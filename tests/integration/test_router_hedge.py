"""A frozen ranker (its process stopped, connections open) costs a Rank a miss, not its
deadline, when the router hedges: the Rank also goes to the next ranker and the first reply wins."""

import os
import signal
import time

import grpc
import numpy as np

from relaygr.v1 import common_pb2, router_pb2_grpc
from relaygr.wire import rank_request_to_proto
from tests.integration.process_mesh import tiny_mesh
from tests.integration.ranker_harness import reply_scores
from tests.unit.ranker.factories import prefix, rank_input, rel_err
from tooling.local.mesh import LocalMesh

HEDGE_MS = 300
DEADLINE_S = 20.0


def test_a_rank_to_a_frozen_ranker_is_answered_by_the_next_one(rng: np.random.Generator) -> None:
    spec, model = tiny_mesh(router_args=("--rank-hedge-ms", str(HEDGE_MS)))
    request = rank_input(rng, prefix(rng, 200, user_id="frozen-owner"), 8, 6)
    expected = model.full_forward(request).numpy()
    with LocalMesh(spec) as mesh, grpc.insecure_channel(mesh.router_target) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        first = router.Rank(rank_request_to_proto(request), timeout=DEADLINE_S)
        owner = mesh.service(first.instance_id)  # the ranker the user's Ranks go to first
        os.kill(owner.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            reply = router.Rank(rank_request_to_proto(request), timeout=DEADLINE_S)
            took = time.monotonic() - started
        finally:
            os.kill(owner.process.pid, signal.SIGCONT)
        assert reply.instance_id != owner.name, "the frozen ranker cannot have answered"
        assert reply.cache_outcome == common_pb2.CACHE_OUTCOME_MISS  # the other has no cache
        assert took < DEADLINE_S / 2, f"answered after {took:.1f} s: no hedge"
        scores = reply_scores(reply)
        assert rel_err(scores, expected) <= 1e-5
        # Thawed, the owner serves its user again (the cancelled hedge left nothing behind).
        again = router.Rank(rank_request_to_proto(request), timeout=DEADLINE_S)
        assert again.instance_id == owner.name
        assert rel_err(reply_scores(again), expected) <= 1e-5
