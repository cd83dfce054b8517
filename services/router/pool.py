"""Pooled gRPC channels from the router to rankers, one per ranker address."""

import grpc

from relaygr.v1 import ranker_pb2_grpc


class RankerPool:
    """One channel (and stub) per ranker address, created on first use and reused.

    Invariant: `retain` closes the channels of addresses no longer live, so a departed ranker's
    connection does not linger.
    """

    def __init__(self, options: list[tuple[str, int]]) -> None:
        self._options = options
        self._channels: dict[str, tuple[grpc.aio.Channel, ranker_pb2_grpc.RankerServiceStub]] = {}

    def stub(self, address: str) -> ranker_pb2_grpc.RankerServiceStub:
        entry = self._channels.get(address)
        if entry is None:
            channel = grpc.aio.insecure_channel(address, options=self._options)
            entry = (channel, ranker_pb2_grpc.RankerServiceStub(channel))
            self._channels[address] = entry
        return entry[1]

    async def retain(self, addresses: set[str]) -> None:
        for address in [a for a in self._channels if a not in addresses]:
            channel, _ = self._channels.pop(address)
            await channel.close()

    async def close(self) -> None:
        await self.retain(set())
