"""A calibrating ranker publishes its cost model's error and refits it to the work it serves."""

import asyncio

import numpy as np

from relaygr.v1 import ranker_pb2
from relaygr.wire import pre_infer_request_to_proto, rank_request_to_proto
from services.ranker.queues import Priority
from tests.integration.ranker_harness import Gate, running_ranker
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input


async def test_describe_publishes_the_fit_error_and_learns_from_served_ranks(
    rng: np.random.Generator,
) -> None:
    async with running_ranker(cost=None, cost_refit_interval_s=0.05) as r:
        info = await r.stub.Describe(ranker_pb2.DescribeRequest())
        calibrated = info.cost_model.samples
        # Two lengths: a prefill, a full inference and two Ranks on the cached prefix each.
        assert calibrated == 8
        assert info.cost_model.median_abs_rel_error >= 0.0
        assert r.engine.cost_model.full_ms(64, 8) > 0
        for i in range(8):  # misses: each one call, its full inference timed (8: a refit's worth)
            request = rank_input(rng, prefix(rng, 20 + 10 * i, user_id=f"u{i}"))
            await r.stub.Rank(rank_request_to_proto(request))

        async def refitted() -> bool:
            info = await r.stub.Describe(ranker_pb2.DescribeRequest())
            return bool(info.cost_model.samples == calibrated + 8)

        await eventually(refitted, "Describe shows the model refitted to the 8 served timings")
        assert r.engine.cost_model.samples == calibrated + 8


async def test_a_calibrating_ranker_times_batches_and_refits_the_batch_term_to_served_ones(
    rng: np.random.Generator,
) -> None:
    """The batch term is timed at start-up, published, and refitted with the rest of the model
    once a served batched call is among the timings: the ranker's wiring from the engine's
    batched call to the learner (`LearnerSink`) and back to Describe and the engine. Queued
    Ranks share a call whatever they save (`batch_backlog` 1)."""
    async with running_ranker(cost=None, cost_refit_interval_s=0.05, batch_backlog=1) as r:
        info = await r.stub.Describe(ranker_pb2.DescribeRequest())
        calibrated = info.cost_model.batch_samples
        assert calibrated == 2 * 3  # two lengths, three rounds
        # Seven PreInfers (a prefill each, timed alone) and one call of three Ranks: eight
        # timings, a refit's worth.
        requests = [rank_input(rng, prefix(rng, 40, user_id=f"u{i}")) for i in range(7)]
        for request in requests:
            await r.stub.PreInfer(pre_infer_request_to_proto(request.prefix))
        gate = Gate(r)
        await gate.wait_entered()
        replies = [
            asyncio.ensure_future(r.stub.Rank(rank_request_to_proto(q))) for q in requests[:3]
        ]
        queued = lambda: r.engine.queues.depth(Priority.RANK) == 3  # noqa: E731
        await eventually(queued, "the Ranks queued behind the held worker")
        gate.open()
        await asyncio.gather(*replies)
        assert r.engine.stats().batch_requests.total == 3  # one call of three

        async def refitted() -> bool:
            info = await r.stub.Describe(ranker_pb2.DescribeRequest())
            return bool(info.cost_model.batch_samples == calibrated + 1)

        await eventually(refitted, "Describe shows the batch term refitted to the served call")
        assert r.engine.cost_model.batch_samples == calibrated + 1
