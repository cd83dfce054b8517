"""Hand-off over gRPC: the sender's streams to its peers (`HandoffPort`) and the receiving
side's wiring (`HandoffReceiving`); PrefixHeader <-> EntryHeader translation for both."""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Tracer

from relaygr.aio import cancellation_requests
from relaygr.behaviours import UserId
from relaygr.tls import open_channel
from relaygr.tls_settings import TlsSettings
from relaygr.tracing import root_span
from relaygr.v1 import ranker_pb2, ranker_pb2_grpc
from services.ranker.handoff import HandoffFailed, HandoffStats, Piece, Receipt, Target
from services.ranker.observer import Origin
from services.ranker.transfer import EntryHeader
from services.ranker.transfer_wire import header_to_proto

_log = logging.getLogger("services.ranker.handoff")

# Metadata naming the sending ranker: the receiver judges ownership as it will be once the
# sender has left.
SENDER_KEY = "relaygr-handoff-from"


class GrpcHandoffPort:
    """One channel and one client-streaming Handoff call per target, traced as a
    `ranker.handoff.send` span of its own trace (a drain is not a request)."""

    def __init__(
        self,
        self_id: str,
        tls: TlsSettings,
        options: Sequence[tuple[str, int]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        tracer: Tracer | None = None,
    ) -> None:
        self._self_id = self_id
        self._tls = tls
        self._options = list(options)
        self._interceptors = list(interceptors)
        self._tracer = tracer

    async def send(self, target: Target, pieces: AsyncIterator[Piece], timeout_s: float) -> Receipt:
        counted = [0, 0]  # entries, bytes
        failed: list[Exception] = []  # what ended the entries' stream, if anything did

        async def messages() -> AsyncIterator[ranker_pb2.PrefixChunk]:
            try:
                async for piece in pieces:
                    if isinstance(piece, EntryHeader):
                        counted[0] += 1
                        yield ranker_pb2.PrefixChunk(header=header_to_proto(piece))
                    else:
                        counted[1] += len(piece)
                        yield ranker_pb2.PrefixChunk(data=bytes(piece))
            except Exception as err:  # gRPC only cancels the call, and says why at debug level
                failed.append(err)
                raise

        attributes = {"relaygr.handoff.target": target.instance_id}
        channel = open_channel(target.address, self._tls, self._options, self._interceptors)
        before = cancellation_requests()
        try:
            with root_span(self._tracer, "ranker.handoff.send", attributes) as span:
                try:
                    reply = await ranker_pb2_grpc.RankerServiceStub(channel).Handoff(
                        messages(), timeout=timeout_s, metadata=((SENDER_KEY, self._self_id),)
                    )
                except grpc.aio.AioRpcError as err:
                    if span is not None:
                        span.set_attributes(
                            {"error": True, "relaygr.handoff.status": err.code().name}
                        )
                    raise HandoffFailed(f"{err.code().name}: {err.details()}") from err
                except asyncio.CancelledError as err:
                    if cancellation_requests() > before:
                        raise  # this sender was cancelled
                    # gRPC cancelled the call under us: the entries' stream raised, or the
                    # receiver ended the call while entries were still being written. The
                    # drain goes on without this stream, as after any failed one.
                    if span is not None:
                        span.set_attributes({"error": True, "relaygr.handoff.status": "CANCELLED"})
                    if failed:
                        raise HandoffFailed(
                            f"CANCELLED: the entries' stream failed: {failed[0]!r}"
                        ) from err
                    raise HandoffFailed(
                        "CANCELLED: the call was cancelled while entries were sent (the "
                        "receiver ended it)"
                    ) from err
                finally:
                    if span is not None:
                        span.set_attributes(
                            {
                                "relaygr.handoff.entries": counted[0],
                                "relaygr.handoff.bytes": counted[1],
                            }
                        )
                if span is not None:
                    span.set_attributes(
                        {
                            "relaygr.handoff.admitted": reply.admitted,
                            "relaygr.handoff.refused": reply.refused,
                        }
                    )
        finally:
            await channel.close()
        return Receipt(reply.admitted, reply.refused, reply.admitted_bytes, tuple(reply.refusals))


# Records where handed-off users' prefixes now live when that is not their hash owner:
# (users admitted, the sender's instance id or "" when not named).
Publish = Callable[[list[UserId], str], Awaitable[None]]


@dataclass(slots=True)
class HandoffReceiving:
    """What the servicer's Handoff needs beside the engine: stats, the bound on streams
    received at once, the tracer, how a received traceparent becomes an origin, and how the
    placement is published (None: standalone, nothing to publish)."""

    stats: HandoffStats
    max_streams: int
    tracer: Tracer | None = None
    origin_of: Callable[[str], Origin | None] = lambda _: None
    publish: Publish | None = None
    publish_timeout_s: float = 5.0
    streams: int = 0  # received now
    _publishing: set[asyncio.Task[None]] = field(default_factory=set)

    def publish_later(self, users: list[UserId], sender: str) -> None:
        """Publish in the background: the sender's reply does not wait on etcd."""
        if self.publish is None or not users:
            return
        task = asyncio.get_running_loop().create_task(self._publish(users, sender))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, users: list[UserId], sender: str) -> None:
        assert self.publish is not None
        try:
            await asyncio.wait_for(self.publish(users, sender), self.publish_timeout_s)
        except Exception as err:  # etcd unreachable or slow: serving goes on
            _log.warning("hand-off placements of %d users not published: %r", len(users), err)
