"""The shared service lifecycle on a real server: shutdown order, and the serve loop's signals."""

import asyncio
import logging
import signal
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relaygr.balancing import replica_options
from relaygr.grpc_server import GrpcServer, drain, start_server
from relaygr.lifecycle import serve, start_service_servers, stop_service
from relaygr.service_options import ServiceOptions
from relaygr.telemetry import Telemetry
from tests.polling import eventually

SERVICE = "relaygr.v1.FakeService"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FakeService:
    """A `RunningService` that records, at each lifecycle step, what a caller would see."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        self.steps: list[tuple[str, object]] = []

    @property
    def port(self) -> int:
        return self.server.port

    async def health(self) -> object:
        """The health status, or the RPC's status code once the server no longer answers."""
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(request, timeout=5)
        except grpc.aio.AioRpcError as err:
            return err.code()
        return reply.status

    async def drain(self, grace_s: float) -> None:
        self.steps.append((f"drain {grace_s}", await self.health()))

    async def close(self) -> None:
        self.steps.append(("close", await self.health()))
        await self.channel.close()


def _no_services(server: grpc.aio.Server) -> None:
    """Health and reflection only: the lifecycle is what is under test."""


async def serving_fake(cfg: ServiceOptions, started: list[FakeService]) -> asyncio.Task[None]:
    """`serve` running a SERVING `FakeService` (kept in `started`) on `cfg`, once its signal
    handler is in: it replaces the default once the service is up, and a SIGTERM before would
    kill the test."""

    async def start(telemetry: Telemetry) -> FakeService:
        server, metrics_server = await start_service_servers(
            cfg, "fake", _no_services, [SERVICE], telemetry, logging.getLogger("fake")
        )
        assert metrics_server is None  # metrics_port 0
        await server.set_serving(True)
        started.append(FakeService(server))
        return started[0]

    before = signal.getsignal(signal.SIGTERM)
    serving = asyncio.create_task(serve(cfg, "fake", start))
    await eventually(lambda: signal.getsignal(signal.SIGTERM) != before, "SIGTERM handled")
    return serving


def test_stop_service_turns_not_serving_then_drains_stops_and_closes() -> None:
    async def scenario() -> list[tuple[str, object]]:
        service = FakeService(await start_server("127.0.0.1:0", _no_services, [SERVICE]))
        await service.server.set_serving(True)
        await stop_service(service, 0.5)
        return service.steps

    steps = asyncio.run(scenario())
    # Draining, the server still answers (NOT_SERVING); closing, it has stopped.
    assert steps == [("drain 0.5", NOT_SERVING), ("close", grpc.StatusCode.UNAVAILABLE)]


def test_serve_runs_until_sigterm_then_shuts_down_in_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = ServiceOptions(plaintext=True, listen="127.0.0.1:0", drain_grace_s=0.5)
    started: list[FakeService] = []

    async def scenario() -> None:
        serving = await serving_fake(cfg, started)
        assert await started[0].health() == health_pb2.HealthCheckResponse.SERVING
        signal.raise_signal(signal.SIGTERM)
        await asyncio.wait_for(serving, timeout=10)

    asyncio.run(scenario())
    port = started[0].port
    assert f"relaygr fake listening on port {port}\n" in capsys.readouterr().out
    assert started[0].steps == [("drain 0.5", NOT_SERVING), ("close", grpc.StatusCode.UNAVAILABLE)]


def test_on_sigterm_health_lingers_not_serving_before_the_drain() -> None:
    """`health_linger_s` passes between health turning NOT_SERVING and the drain, the server
    answering meanwhile: time for callers that watch health to move to another replica."""
    cfg = ServiceOptions(
        plaintext=True, listen="127.0.0.1:0", drain_grace_s=0.5, health_linger_s=0.4
    )
    started: list[FakeService] = []
    seen: list[tuple[float, object]] = []  # (seconds after SIGTERM, health), polled

    async def scenario() -> float:
        serving = await serving_fake(cfg, started)
        sent = time.monotonic()
        signal.raise_signal(signal.SIGTERM)
        while not started[0].steps:  # polls until the drain step is recorded
            seen.append((time.monotonic() - sent, await started[0].health()))
        drained = time.monotonic() - sent
        await asyncio.wait_for(serving, timeout=10)
        return drained

    drained = asyncio.run(scenario())
    assert drained >= cfg.health_linger_s, drained
    lingering = [status for at, status in seen if 0.1 <= at <= cfg.health_linger_s]
    assert lingering and set(lingering) == {NOT_SERVING}, seen  # answered, NOT_SERVING
    assert started[0].steps == [("drain 0.5", NOT_SERVING), ("close", grpc.StatusCode.UNAVAILABLE)]


def test_a_replica_draining_fails_no_call_of_a_caller_that_watches_health() -> None:
    """Two replicas; a caller with `replica_options` sends from 32 tasks without pause while
    one replica shuts down as on SIGTERM (NOT_SERVING, the linger, drain, stop): every call
    succeeds, and once it has stopped the other replica serves them all. With no linger, or
    a caller that does not watch health, calls that reach the stopping server end CANCELLED
    (grpc/grpc#41785), a status no caller may retry."""

    async def scenario() -> tuple[Counter[str], int]:
        servers = [await start_server("127.0.0.1:0", _no_services, [SERVICE]) for _ in range(2)]
        for server in servers:
            await server.set_serving(True)
        target = "ipv4:" + ",".join(f"127.0.0.1:{server.port}" for server in servers)
        outcomes: Counter[str] = Counter()
        after_stop = 0
        stopped = asyncio.Event()
        done = asyncio.Event()
        async with grpc.aio.insecure_channel(target, options=replica_options(SERVICE)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=SERVICE)

            async def caller() -> None:
                nonlocal after_stop
                while not done.is_set():
                    try:
                        await stub.Check(request, timeout=5)
                        outcomes["OK"] += 1
                        after_stop += stopped.is_set()
                    except grpc.aio.AioRpcError as err:
                        outcomes[err.code().name] += 1

            callers = [asyncio.create_task(caller()) for _ in range(32)]
            await eventually(lambda: outcomes["OK"] >= 200, "calls served by both replicas")
            await drain(servers[0], grace=5.0, linger_s=0.5)
            stopped.set()
            await eventually(lambda: after_stop >= 200, "calls served after the stop")
            done.set()
            await asyncio.gather(*callers)
        await servers[1].stop(0)
        return outcomes, after_stop

    outcomes, after_stop = asyncio.run(scenario())
    assert set(outcomes) == {"OK"}, outcomes
    assert after_stop >= 200
