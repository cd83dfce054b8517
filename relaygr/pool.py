"""Pooled gRPC channels from the router to rankers, one per ranker address, carrying raw bytes."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from relaygr.channel_renewal import ChannelRenewal
from relaygr.tls import ChannelOption, open_channel
from relaygr.tls_settings import TlsSettings

# A ranker method taking and returning serialized messages: (request bytes, timeout) -> reply.
RawCall = Callable[..., Awaitable[bytes]]
# A ranker method streaming its reply: (request bytes, timeout) -> reply messages' bytes.
RawStream = Callable[..., AsyncIterator[bytes]]
_METHODS = ("PreInfer", "Rank", "Describe")
_STREAMS = ("Fetch",)  # a peer ranker fetching a prefix (services/ranker/fetch_client.py)
_SERVICE = "/relaygr.v1.RankerService/"


class RankerPool:
    """One channel per ranker address, created on first use and reused.

    Calls carry serialized messages both ways: the router forwards a request's bytes and the
    reply's bytes without parsing them again. Invariant: `retain` closes the channels of
    addresses no longer live, so a departed ranker's connection does not linger; when the TLS
    files change, every channel is replaced on its next use and the old ones finish their calls.
    """

    def __init__(
        self,
        options: list[ChannelOption],
        tls: TlsSettings,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        """`tls`: the owning service's settings; every channel is TLS unless it is plaintext.
        `interceptors` (tracing: W3C trace context on every call) wrap every channel's calls."""
        self._options = options
        self._tls = tls
        self._interceptors = interceptors
        self._channels: dict[str, tuple[grpc.aio.Channel, dict[str, RawCall]]] = {}
        self._renewal = ChannelRenewal(tls)

    def call(self, address: str, method: str) -> RawCall:
        """The raw callable of a RankerService `method` on the ranker at `address`."""
        return self._open(address)[1][method]

    def stream(self, address: str, method: str) -> RawStream:
        """The raw callable of a server-streaming RankerService `method` (Fetch)."""
        if method not in _STREAMS:
            raise KeyError(method)
        channel = self._open(address)[0]
        return channel.unary_stream(_SERVICE + method)  # type: ignore[return-value]

    def _open(self, address: str) -> tuple[grpc.aio.Channel, dict[str, RawCall]]:
        if self._renewal.due():
            self._renewal.retire(channel for channel, _ in self._channels.values())
            self._channels.clear()
        entry = self._channels.get(address)
        if entry is None:
            channel = open_channel(address, self._tls, self._options, self._interceptors)
            calls = {m: channel.unary_unary(_SERVICE + m) for m in _METHODS}
            entry = (channel, calls)  # type: ignore[assignment]
            self._channels[address] = entry
        return entry

    @property
    def renewals(self) -> int:
        """Times every channel was replaced after the TLS files changed."""
        return self._renewal.renewals

    def addresses(self) -> set[str]:
        """The addresses a channel is open to."""
        return set(self._channels)

    async def retain(self, addresses: set[str], grace_s: float | None = None) -> None:
        """Close the channels to other addresses, letting their calls run up to `grace_s`."""
        closing = [self._channels.pop(a)[0] for a in list(self._channels) if a not in addresses]
        await asyncio.gather(*(channel.close(grace_s) for channel in closing))

    async def close(self) -> None:
        await self.retain(set())
        await self._renewal.close()
