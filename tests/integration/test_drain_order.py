"""The drain's order on loopback (real etcd, real rankers): a draining ranker stays registered,
so its users keep being routed to it, until its receivers hold the prefixes it hands off; only
then does it leave the membership.

Each receiver is reached through a forwarding proxy (its advertised address): when the real
receiver has answered a hand-off stream, the proxy checks that the receiver holds every entry
of the stream and reads the sender's membership key from etcd (a linearizable read, not a
watched view that may lag), before the sender gets its receipt and goes on.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from relaygr.etcd.client import EtcdClient
from relaygr.placement import ranking
from relaygr.v1 import ranker_pb2, ranker_pb2_grpc
from services.ranker.handoff_grpc import SENDER_KEY
from services.ranker.kv_store import CacheKey
from services.ranker.server import RankerServer
from services.ranker.transfer_wire import header_from_proto
from tests.integration.etcd_server import EtcdServer
from tests.integration.mesh_harness import running_mesh
from tests.integration.ranker_harness import BASE, tiny_model
from tests.unit.ranker.factories import prefix

RANKERS = ("r0", "r1", "r2")


@dataclass(frozen=True, slots=True)
class Moment:
    """What held when a receiver had answered one hand-off stream."""

    receiver: str
    entries: int
    held: int  # of those entries, how many the receiver holds
    sender_registered: bool


@dataclass
class HandoffProxy(ranker_pb2_grpc.RankerServiceServicer):
    """Forwards Handoff to a real receiver, then records a `Moment` before answering."""

    name: str
    etcd: EtcdClient
    receiver: RankerServer | None = None
    moments: list[Moment] = field(default_factory=list)

    async def Handoff(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[ranker_pb2.PrefixChunk],
        context: grpc.aio.ServicerContext,
    ) -> ranker_pb2.HandoffReply:
        receiver = self.receiver
        assert receiver is not None and receiver.engine is not None
        sender = dict(context.invocation_metadata() or ())[SENDER_KEY]
        keys: list[CacheKey] = []

        async def forwarded() -> AsyncIterator[ranker_pb2.PrefixChunk]:
            async for chunk in request_iterator:
                if chunk.HasField("header"):
                    keys.append(header_from_proto(chunk.header).key)
                yield chunk

        async with grpc.aio.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
            reply = await ranker_pb2_grpc.RankerServiceStub(channel).Handoff(
                forwarded(), metadata=((SENDER_KEY, sender),), timeout=10
            )
        held = sum(receiver.engine.held_for_peer(key) is not None for key in keys)
        member = f"{BASE.etcd_prefix.rstrip('/')}/rankers/{sender}"
        registered = await self.etcd.get(member) is not None
        self.moments.append(Moment(self.name, len(keys), held, registered))
        return reply  # type: ignore[no-any-return]


async def test_a_draining_ranker_stays_registered_until_its_receivers_hold_its_prefixes(
    etcd_server: EtcdServer, rng: np.random.Generator
) -> None:
    model = tiny_model()
    etcd = EtcdClient([etcd_server.endpoint])
    proxies = {name: HandoffProxy(name, etcd) for name in RANKERS[1:]}
    servers = []
    try:
        async with running_mesh(etcd_server.endpoint, model) as mesh:
            sender = await mesh.add_ranker("r0")
            for name, proxy in proxies.items():
                server = grpc.aio.server()
                ranker_pb2_grpc.add_RankerServiceServicer_to_server(proxy, server)
                port = server.add_insecure_port("127.0.0.1:0")
                await server.start()
                servers.append(server)
                proxy.receiver = await mesh.add_ranker(name, advertise_address=f"127.0.0.1:{port}")
            # Two users of r0 for each receiver (their next owner once r0 leaves).
            users: dict[str, list[str]] = {name: [] for name in proxies}
            for i in range(10_000):
                order = ranking(f"u{i}", RANKERS)
                if order[0] == "r0" and len(users[order[1]]) < 2:
                    users[order[1]].append(f"u{i}")
                if all(len(v) == 2 for v in users.values()):
                    break
            print("users by receiver", users)
            assert sender.engine is not None
            for user in (u for v in users.values() for u in v):
                await sender.engine.pre_infer(prefix(rng, 64, user_id=user), None, None)
            del mesh.rankers["r0"]
            await sender.stop(grace=2.0)  # SIGTERM's path: NOT_SERVING, drain, stop, close
            member = f"{BASE.etcd_prefix.rstrip('/')}/rankers/r0"
            assert await etcd.get(member) is None  # it did leave, once done
            moments = sorted(
                (m for proxy in proxies.values() for m in proxy.moments), key=lambda m: m.receiver
            )
            assert moments == [
                Moment("r1", len(users["r1"]), len(users["r1"]), sender_registered=True),
                Moment("r2", len(users["r2"]), len(users["r2"]), sender_registered=True),
            ]
    finally:
        for server in servers:
            await server.stop(0)
        await etcd.close()
