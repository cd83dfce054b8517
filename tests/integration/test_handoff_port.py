"""The hand-off's gRPC sender (`GrpcHandoffPort.send`) against a real server on loopback: a call
that gRPC cancels under the sender is a failed stream (the drain goes on), while a cancellation
of the sender itself still propagates."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from relaygr.tls_settings import PLAINTEXT
from services.ranker.handoff import HandoffFailed, Piece, Target
from services.ranker.handoff_grpc import GrpcHandoffPort
from tests.integration.one_method import serve_one_method

Handler = Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Awaitable[bytes]]


async def serving(handler: Handler) -> tuple[grpc.aio.Server, Target]:
    server, port = await serve_one_method(
        "relaygr.v1.RankerService", "Handoff", grpc.stream_unary_rpc_method_handler(handler)
    )
    return server, Target("receiver", f"127.0.0.1:{port}")


async def test_an_entries_stream_that_raises_is_a_failed_hand_off_naming_the_error() -> None:
    # gRPC answers an exception from the request stream by cancelling the call: the awaiting
    # sender then sees CancelledError, which is not its own cancellation.
    async def receive(requests: AsyncIterator[bytes], _: grpc.aio.ServicerContext) -> bytes:
        async for _chunk in requests:
            pass
        return b""  # an empty HandoffReply

    async def pieces() -> AsyncIterator[Piece]:
        yield b"first chunk"
        raise RuntimeError("could not encode the entry")

    server, target = await serving(receive)
    try:
        with pytest.raises(HandoffFailed, match=r"CANCELLED: .*could not encode the entry"):
            await GrpcHandoffPort("sender", PLAINTEXT).send(target, pieces(), timeout_s=10.0)
    finally:
        await server.stop(None)


async def test_a_cancelled_sender_is_cancelled_not_failed() -> None:
    first = asyncio.Event()

    async def stall(requests: AsyncIterator[bytes], _: grpc.aio.ServicerContext) -> bytes:
        async for _chunk in requests:
            first.set()
        await asyncio.Event().wait()  # never replies
        return b""

    async def pieces() -> AsyncIterator[Piece]:
        yield b"only chunk"

    server, target = await serving(stall)
    try:
        port = GrpcHandoffPort("sender", PLAINTEXT)
        sending = asyncio.create_task(port.send(target, pieces(), timeout_s=30.0))
        await first.wait()
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        assert sending.cancelled()
    finally:
        await server.stop(None)
