"""The pipeline driver is open loop: a slow server does not delay later sends."""

import asyncio

import grpc
import numpy as np

from relaygr.local.drive import drive
from relaygr.local.workload import Arrival
from tests.unit.ranker.factories import prefix, rank_input

SERVER_DELAY_S = 0.3


async def test_a_slow_server_does_not_shift_the_send_times(rng: np.random.Generator) -> None:
    arrivals = [
        Arrival(0.05 * i, rank_input(rng, prefix(rng, 4, user_id=f"u{i}"), 2, 2)) for i in range(20)
    ]  # one request every 50 ms, each answered only after 300 ms
    received: list[float] = []

    async def slow_rank(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        received.append(asyncio.get_running_loop().time())
        await asyncio.sleep(SERVER_DELAY_S)  # the slow server under test, not synchronisation
        return b""  # an empty RankReply

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "relaygr.v1.RouterService", {"Rank": grpc.unary_unary_rpc_method_handler(slow_rank)}
    ),))  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        point = await drive(
            None, f"127.0.0.1:{port}", arrivals, label="slow", rate=20.0, gap_s=0.1,
            warmup_s=0.0, timeout_s=5.0,
        )  # fmt: skip
    finally:
        await server.stop(None)
    assert point.ok == len(arrivals)
    sent = np.array(received) - received[0]
    intended = np.array([a.at for a in arrivals]) - arrivals[0].at
    drift = np.abs(sent - intended)
    assert drift.max() < 0.03, drift  # sends keep to the schedule, 20 in flight at once
    assert min(point.latencies_ms) >= SERVER_DELAY_S * 1e3  # measured from intended time
