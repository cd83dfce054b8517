"""Fills a RelayRoom from every live ranker's Describe, over the owner's pooled ranker channels."""

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.trace import Tracer

from relaygr.cluster import RankerRecord
from relaygr.pool import RankerPool
from relaygr.room import RelayRoom, RoomReport
from relaygr.tracing import root_span
from relaygr.v1 import ranker_pb2

_log = logging.getLogger("relaygr.room")


class RoomPoller:
    """Asks each ranker in `view()` for its relay room every `interval_s` and books the answers
    in `room` under `clock` (the clock the room's owner decides with).

    A round asks every ranker at once; an observation is booked at the time its question was
    sent (see `RelayRoom.observe`), and a ranker that does not answer keeps its last one, which
    ages out. With tracing on, each round is one trace (`span_name`) holding its Describe calls.
    """

    def __init__(
        self,
        room: RelayRoom,
        pool: RankerPool,
        view: Callable[[], Mapping[str, RankerRecord]],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
        span_name: str = "relaygr.observe",
    ) -> None:
        self.room = room
        self._pool = pool
        self._view = view
        self.interval_s = interval_s
        self._clock = clock
        self._tracer = tracer
        self._span_name = span_name
        self.rounds = 0

    async def poll_once(self) -> Mapping[str, RankerRecord]:
        """One round; returns the view it asked, then forgets what left it or expired."""
        view = self._view()
        with root_span(self._tracer, self._span_name, {"relaygr.rankers": len(view)}):
            await asyncio.gather(*(self._describe(i, r.address) for i, r in view.items()))
        self.room.sweep(self._clock(), view)
        self.rounds += 1
        return view

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def _describe(self, instance: str, address: str) -> None:
        sent_at = self._clock()
        try:
            raw = await self._pool.call(address, "Describe")(b"", timeout=max(self.interval_s, 1.0))
            info = ranker_pb2.RankerInfo.FromString(raw)
        except grpc.aio.AioRpcError as err:
            _log.debug("describe %s failed: %s", instance, err.code().name)
            return
        except DecodeError as err:
            _log.warning("describe %s: malformed reply: %s", instance, err)
            return
        hbm = info.hbm
        report = RoomReport(
            hbm.pinned_bytes, hbm.budget_bytes, info.queued_prefill_ms, info.queued_rank_ms,
            info.relays_consumed, info.relays_expired_unconsumed, info.relay_wait_p99_ms,
        )  # fmt: skip
        self.room.observe(instance, report, sent_at)
