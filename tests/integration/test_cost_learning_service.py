"""A calibrating ranker publishes its cost model's error and refits it to the work it serves."""

import numpy as np

from relaygr.v1 import ranker_pb2
from relaygr.wire import rank_request_to_proto
from tests.integration.ranker_harness import running_ranker
from tests.polling import eventually
from tests.unit.ranker.factories import prefix, rank_input


async def test_describe_publishes_the_fit_error_and_learns_from_served_ranks(
    rng: np.random.Generator,
) -> None:
    async with running_ranker(cost=None, cost_refit_interval_s=0.05) as r:
        info = await r.stub.Describe(ranker_pb2.DescribeRequest())
        calibrated = info.cost_model.samples
        assert calibrated == 4  # two lengths: a prefill and a full inference each
        assert info.cost_model.median_abs_rel_error >= 0.0
        assert r.engine.cost_model.full_ms(64, 8) > 0
        for i in range(4):  # misses: each times a prefill and a rank, 8 timings (a refit's worth)
            request = rank_input(rng, prefix(rng, 20 + 10 * i, user_id=f"u{i}"))
            await r.stub.Rank(rank_request_to_proto(request))

        async def refitted() -> bool:
            info = await r.stub.Describe(ranker_pb2.DescribeRequest())
            return bool(info.cost_model.samples == calibrated + 8)

        await eventually(refitted, "Describe shows the model refitted to the 8 served timings")
        assert r.engine.cost_model.samples == calibrated + 8
