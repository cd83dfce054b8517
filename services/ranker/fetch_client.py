"""Peer fetch over gRPC: whom a miss asks (its directory entry, its previous owner) and the
Fetch call, each entry checked on receipt by `transfer.Receiver`. The `PeerSource` of `fetch`."""

import asyncio
import time
from collections.abc import Callable, Mapping

import grpc
import torch
from google.protobuf.message import DecodeError

from relaygr.cluster import Directory, RankerRecord
from relaygr.pool import RankerPool
from relaygr.v1 import ranker_pb2
from services.ranker.fetch import Fetched, Peer
from services.ranker.kv_store import CacheKey
from services.ranker.model_config import ModelConfig
from services.ranker.outcomes import FetchResult
from services.ranker.peers import PreviousOwners, fetch_peers
from services.ranker.transfer import EntryHeader, Receiver, Refusal
from services.ranker.transfer_wire import header_from_proto

_BY_CODE = {
    grpc.StatusCode.NOT_FOUND: FetchResult.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED: FetchResult.TIMEOUT,
}


class GrpcPeerSource:
    """Fetches from peer rankers through `pool` (the mesh's TLS settings and tracing).

    Peers, most likely first: the instance the directory records for the user, then the user's
    previous owner in its rendezvous order (`peers.successor`); each a live member serving the
    key's model version, never this ranker. The previous owner is asked only while `owners`
    says so (after the last ranker joined or left at `changed_at()`; by default always), and
    each of its answers is reported there: a cold miss in a settled or a cold fleet pays no
    round trip. A stream must carry exactly one entry, the one asked for; anything else is
    refused.
    """

    def __init__(
        self,
        pool: RankerPool,
        view: Callable[[], Mapping[str, RankerRecord]],
        directory: Directory | None,
        self_id: str,
        cfg: ModelConfig,
        device: torch.device,
        owners: PreviousOwners | None = None,
        changed_at: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`changed_at` and `clock`: wall-clock seconds (read only with `owners`)."""
        self._owners = owners
        self._changed_at = changed_at
        self._clock = clock
        self._pool = pool
        self._view = view
        self._directory = directory
        self._self_id = self_id
        self._cfg = cfg
        self._device = device

    def peers(self, key: CacheKey) -> list[Peer]:
        view = self._view()
        holder = None
        if self._directory is not None:
            holder = self._directory.lookup(key.user_id, key.model_version)
        owners = self._owners
        moved = owners is None or owners.asking(self._clock(), self._changed_at())
        asks = fetch_peers(key.user_id, key.model_version, view, self._self_id, holder, moved)
        return [Peer(i, view[i].address, previous) for i, previous in asks]

    async def fetch(self, key: CacheKey, peer: Peer, timeout_s: float) -> Fetched | FetchResult:
        got = await self._fetch(key, peer, timeout_s)
        if peer.previous_owner and self._owners is not None:
            self._owners.answered(isinstance(got, Fetched))
        return got

    async def _fetch(self, key: CacheKey, peer: Peer, timeout_s: float) -> Fetched | FetchResult:
        request = ranker_pb2.FetchRequest(
            user_id=key.user_id, model_version=key.model_version, prefix_digest=key.digest
        )
        receiver = Receiver(self._cfg, key.model_version, self._device)
        header: EntryHeader | None = None
        call = self._pool.stream(peer.address, "Fetch")(
            request.SerializeToString(), timeout=timeout_s
        )
        try:
            async for raw in call:
                chunk = ranker_pb2.PrefixChunk.FromString(raw)
                if chunk.HasField("header"):
                    if header is not None:  # one entry per fetch
                        return _refuse(call)
                    header = header_from_proto(chunk.header)
                    if header.key != key or receiver.start(header) is not None:
                        return _refuse(call)
                elif receiver.add(chunk.data) is not None:
                    return _refuse(call)
        except grpc.aio.AioRpcError as err:
            return _BY_CODE.get(err.code(), FetchResult.ERROR)
        except DecodeError:
            return _refuse(call)
        if header is None:
            return FetchResult.REFUSED
        # The content digest and the copy to the device: off the event loop.
        received = await asyncio.to_thread(receiver.finish)
        if isinstance(received, Refusal):
            return FetchResult.REFUSED
        return Fetched(received, header.origin_traceparent)


def _refuse(call: object) -> FetchResult:
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        cancel()
    return FetchResult.REFUSED
