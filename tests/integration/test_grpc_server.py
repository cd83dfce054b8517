"""Real aio servers on loopback exercising the shared interceptor, health, reflection and drain."""

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from relaygr.errors import (
    ConfigError,
    DeadlineExceeded,
    DeviceUnavailable,
    InvalidInput,
    RelayGRError,
    ResourceExhausted,
    Unavailable,
)
from relaygr.grpc_server import (
    GrpcServer,
    absolute_deadline,
    install_drain_handlers,
    start_server,
)
from relaygr.service_options import ServerOptions
from relaygr.v1 import ranker_pb2, ranker_pb2_grpc
from tests.polling import eventually

SERVICE = "relaygr.v1.RankerService"
Action = Callable[[grpc.aio.ServicerContext], Awaitable[None]]


class FakeRanker:
    """Describe runs `action` (if any) once per call, then answers with instance "r0"."""

    def __init__(self) -> None:
        self.action: Action | None = None

    async def describe(
        self, request: ranker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> ranker_pb2.RankerInfo:
        if self.action is not None:
            await self.action(context)
        return ranker_pb2.RankerInfo(instance_id="r0")

    def register(self, server: grpc.aio.Server) -> None:
        method = grpc.unary_unary_rpc_method_handler(
            self.describe,
            request_deserializer=ranker_pb2.DescribeRequest.FromString,
            response_serializer=ranker_pb2.RankerInfo.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Describe": method}),)
        )


def raising(err: BaseException) -> Action:
    async def action(context: grpc.aio.ServicerContext) -> None:
        raise err

    return action


@asynccontextmanager
async def serving(ranker: FakeRanker) -> AsyncIterator[tuple[GrpcServer, grpc.aio.Channel]]:
    server = await start_server("127.0.0.1:0", ranker.register, [SERVICE])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, channel
    finally:
        await channel.close()
        await server.stop(grace=0)


async def describe(channel: grpc.aio.Channel) -> ranker_pb2.RankerInfo:
    stub = ranker_pb2_grpc.RankerServiceStub(channel)
    return await stub.Describe(ranker_pb2.DescribeRequest(), timeout=10)


async def health(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return reply.status


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (InvalidInput("user_id is empty"), grpc.StatusCode.INVALID_ARGUMENT),
        (ResourceExhausted("prefix needs 9 MiB, 2 MiB free"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Unavailable("no ranker alive"), grpc.StatusCode.UNAVAILABLE),
        (DeadlineExceeded("deadline passed in queue"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (ConfigError("bad tier budget"), grpc.StatusCode.INTERNAL),
        (DeviceUnavailable("no npu:0"), grpc.StatusCode.INTERNAL),
        (RelayGRError("something of ours"), grpc.StatusCode.INTERNAL),
    ],
)
async def test_errors_map_to_status_codes_with_their_message(
    err: RelayGRError, code: grpc.StatusCode
) -> None:
    ranker = FakeRanker()
    ranker.action = raising(err)
    async with serving(ranker) as (_, channel):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await describe(channel)
    assert info.value.code() == code
    assert info.value.details() == str(err)


async def test_unexpected_error_is_internal_logged_and_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="relaygr.grpc_server"):
        ranker = FakeRanker()
        ranker.action = raising(ValueError("secret detail"))
        async with serving(ranker) as (_, channel):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await describe(channel)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "secret detail" not in (info.value.details() or "")
            ranker.action = None
            assert (await describe(channel)).instance_id == "r0"
    [record] = [r for r in caplog.records if r.name == "relaygr.grpc_server"]
    assert record.exc_info is not None and record.exc_info[0] is ValueError


async def test_handler_abort_keeps_its_status() -> None:
    async def abort(context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")

    ranker = FakeRanker()
    ranker.action = abort
    async with serving(ranker) as (_, channel):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await describe(channel)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == "model not loaded"


async def test_health_is_not_serving_until_marked_serving() -> None:
    async with serving(FakeRanker()) as (server, channel):
        for name in ("", SERVICE):
            assert await health(channel, name) == health_pb2.HealthCheckResponse.NOT_SERVING
        await server.set_serving(True)
        for name in ("", SERVICE):
            assert await health(channel, name) == health_pb2.HealthCheckResponse.SERVING
        await server.set_serving(False)
        assert await health(channel, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_reflection_lists_the_service_health_and_reflection() -> None:
    async with serving(FakeRanker()) as (_, channel):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name async for r in call for s in r.list_services_response.service}
    assert names == {
        SERVICE,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value, shift, i = value | (byte & 0x7F) << shift, shift + 7, i + 1
        if byte < 0x80:
            return value, i


def _fields(data: bytes) -> dict[int, list[bytes]]:
    """A message's length-delimited fields by number, read off the wire (varints skipped)."""
    fields: dict[int, list[bytes]] = {}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        if key & 7 == 0:
            _, i = _varint(data, i)
            continue
        assert key & 7 == 2, f"wire type {key & 7}"
        size, i = _varint(data, i)
        fields.setdefault(key >> 3, []).append(data[i : i + size])
        i += size
    return fields


async def test_a_client_speaking_only_reflection_v1_lists_and_describes_the_services() -> None:
    """A v1 client, written from grpc/reflection/v1/reflection.proto alone: requests and
    replies are encoded by hand, so nothing of v1alpha is on its side."""

    def request(number: int, text: str) -> bytes:  # ServerReflectionRequest, one oneof field
        return bytes([number << 3 | 2, len(text)]) + text.encode()

    list_services = request(7, "*")
    symbols = [SERVICE, "grpc.reflection.v1.ServerReflection"]
    async with serving(FakeRanker()) as (_, channel):
        call = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")
        replies = [
            _fields(reply)
            async for reply in call(iter([list_services, *(request(4, s) for s in symbols)]))
        ]
    listed, *described = replies
    services = _fields(listed[6][0])[1]  # list_services_response.service
    assert {_fields(service)[1][0].decode() for service in services} == {
        SERVICE,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    files = {}
    for reply in described:  # file_descriptor_response.file_descriptor_proto: the first one
        assert 7 not in reply, reply  # no error_response
        first = _fields(reply[4][0])[1][0]
        proto = descriptor_pb2.FileDescriptorProto.FromString(first)
        files[proto.package] = proto
    assert [s.name for s in files["relaygr.v1"].service] == ["RankerService"]
    [v1] = files["grpc.reflection.v1"].service
    [method] = v1.method
    assert (v1.name, method.name) == ("ServerReflection", "ServerReflectionInfo")
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert method.output_type == ".grpc.reflection.v1.ServerReflectionResponse"


async def test_two_servers_bind_distinct_ports_in_parallel() -> None:
    async with serving(FakeRanker()) as (a, chan_a), serving(FakeRanker()) as (b, chan_b):
        assert a.port != 0 and b.port != 0 and a.port != b.port
        assert (await describe(chan_a)).instance_id == "r0"
        assert (await describe(chan_b)).instance_id == "r0"


async def test_binding_a_taken_port_is_a_config_error() -> None:
    async with serving(FakeRanker()) as (server, _):
        with pytest.raises(ConfigError, match="cannot bind"):
            await start_server(f"127.0.0.1:{server.port}", FakeRanker().register, [SERVICE])


async def until_rejected(channel: grpc.aio.Channel, within: float = 10.0) -> None:
    """Poll with fresh RPCs until the server refuses them (it has begun stopping)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            await describe(channel)
        except grpc.aio.AioRpcError as err:
            # Core cancels calls that reach a server already shutting down.
            assert err.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            return
    raise AssertionError("server still accepted new RPCs")


async def test_stop_finishes_in_flight_request_within_grace() -> None:
    ranker = FakeRanker()
    started, release = asyncio.Event(), asyncio.Event()

    async def slow_once(context: grpc.aio.ServicerContext) -> None:
        ranker.action = None  # only the first call is slow; later ones probe the server
        started.set()
        await release.wait()

    ranker.action = slow_once
    server = await start_server("127.0.0.1:0", ranker.register, [SERVICE])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        in_flight = asyncio.create_task(describe(channel))
        await started.wait()
        stopping = asyncio.create_task(server.stop(grace=30))
        await until_rejected(channel)
        release.set()
        assert (await in_flight).instance_id == "r0"
        await stopping


async def test_connections_end_at_their_max_age_and_no_call_fails() -> None:
    """With `max_connection_age_s` the server ends each client connection at that age (GOAWAY):
    the client connects again (and would resolve its target again), a call in flight finishes
    on the old connection within the grace, and no call fails."""
    ranker = FakeRanker()
    peers: set[str] = set()  # a new connection comes from a new client port
    slow = asyncio.Event()

    async def note_peer(context: grpc.aio.ServicerContext) -> None:
        peers.add(context.peer())
        if not slow.is_set():  # the first call outlives its connection's age
            slow.set()
            await asyncio.sleep(1.0)

    ranker.action = note_peer
    options = ServerOptions(max_connection_age_s=0.2, max_connection_age_grace_s=5.0)
    server = await start_server("127.0.0.1:0", ranker.register, [SERVICE], options)
    failures: list[grpc.StatusCode] = []
    done = asyncio.Event()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:

        async def caller() -> None:
            while not done.is_set():
                try:
                    await describe(channel)
                except grpc.aio.AioRpcError as err:
                    failures.append(err.code())

        first = asyncio.create_task(describe(channel))
        await slow.wait()
        callers = [asyncio.create_task(caller()) for _ in range(4)]
        await eventually(lambda: len(peers) >= 4, "connections renewed")
        assert (await first).instance_id == "r0"
        done.set()
        await asyncio.gather(*callers)
    await server.stop(grace=0)
    assert failures == []


async def test_grace_expiry_cancels_the_handler_without_mapping_it() -> None:
    cancelled: list[bool] = []

    ranker = FakeRanker()
    started = asyncio.Event()

    async def hang(context: grpc.aio.ServicerContext) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    ranker.action = hang
    server = await start_server("127.0.0.1:0", ranker.register, [SERVICE])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        in_flight = asyncio.create_task(describe(channel))
        await started.wait()
        await server.stop(grace=0.05)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await in_flight
    assert info.value.code() != grpc.StatusCode.INTERNAL
    assert cancelled == [True]


async def test_sigterm_drains_not_serving_then_stops() -> None:
    seen: list[int] = []

    async with serving(FakeRanker()) as (server, channel):
        await server.set_serving(True)

        async def on_drain() -> None:
            seen.append(await health(channel, SERVICE))

        done = install_drain_handlers(asyncio.get_running_loop(), server, 5.0, on_drain)
        signal.raise_signal(signal.SIGTERM)
        await asyncio.wait_for(done, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await describe(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING]


def test_absolute_deadline() -> None:
    assert absolute_deadline(None, now=100.0) is None
    assert absolute_deadline(2.5, now=100.0) == 102.5
    assert absolute_deadline(-1.0, now=100.0) == 100.0
