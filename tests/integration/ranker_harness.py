"""A real ranker gRPC server on loopback around a tiny model, and helpers to drive it."""

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import grpc
import numpy as np

from relaygr.cost import CostModel
from relaygr.v1 import common_pb2, ranker_pb2_grpc
from services.ranker.config import RankerConfig
from services.ranker.model import RankingModel
from services.ranker.server import RankerServer, start_ranker
from tests.polling import eventually
from tests.unit.ranker.factories import tiny_config

# Reloading a host copy is cheap, recomputing is not: the shape every real device has.
COST = CostModel(
    fixed_ms=1.0, per_token_ms=0.01, per_pair_ms=1e-6, per_candidate_key_ms=1e-5,
    reload_ms_per_mb=0.01,
)  # fmt: skip

# No cost per model call: a Rank that finds its prefix queued waits for it (chunks cost no more
# than one call computing it), so "waited in flight" is the predicted-sooner choice.
NO_CALL_COST = replace(COST, fixed_ms=0.0)

BASE = RankerConfig(
    listen="127.0.0.1:0",
    plaintext=True,  # tests/integration/test_security.py runs the same services over mTLS
    calibration_lengths=(32, 64),
    calibration_candidates=8,
    prefill_chunk_tokens=64,
    prefill_chunk_fixed_share=1.0,  # chunks as configured: the tests count them
)


def tiny_model(**overrides: object) -> RankingModel:
    return RankingModel(tiny_config(**overrides), seed=7)


def reply_scores(reply: common_pb2.RankReply) -> np.ndarray:
    """A RankReply's scores as a (tasks, candidates) array."""
    return np.array([list(task.scores) for task in reply.scores])


def reverse_timestamp(behaviours: common_pb2.Behaviours, what: str, i: int) -> str:
    """Set entry `i` of the sorted `behaviours.timestamps` (a sequence named `what`) one second
    before entry i - 1, and return the refusal a server must answer with."""
    before = behaviours.timestamps[i - 1]
    behaviours.timestamps[i] = before - 1
    return (
        f"{what}.timestamps[{i}] = {before - 1} is before timestamps[{i - 1}] = {before};"
        " behaviour timestamps must be non-decreasing"
    )


@dataclass(slots=True)
class Ranker:
    server: RankerServer
    stub: ranker_pb2_grpc.RankerServiceStub
    channel: grpc.aio.Channel

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        assert self.server.engine is not None
        return self.server.engine

    def scores(self, reply: common_pb2.RankReply) -> np.ndarray:
        return reply_scores(reply)


@asynccontextmanager
async def running_ranker(
    model: RankingModel | None = None, cost: CostModel | None = COST, **config: object
) -> AsyncIterator[Ranker]:
    cfg = replace(BASE, **config)  # type: ignore[arg-type]
    server = await start_ranker(cfg, model=model or tiny_model(), cost_model=cost)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Ranker(server, ranker_pb2_grpc.RankerServiceStub(channel), channel)
    finally:
        await channel.close()
        await server.stop(grace=1.0)


async def poll(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    await eventually(condition, timeout_s=timeout)


class Gate:
    """Holds the ranker's compute worker on a job until released: makes 'in flight' exact."""

    def __init__(self, ranker: Ranker) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

        def hold() -> None:
            self.entered.set()
            self.release.wait(30)

        ranker.engine.worker.run(hold)

    async def wait_entered(self) -> None:
        await poll(self.entered.is_set)

    def open(self) -> None:
        self.release.set()
