"""A ranker's registration in the mesh, from joining to leaving."""

import contextlib

from relaygr.cluster import RankerRecord
from relaygr.errors import Unavailable
from relaygr.lifecycle import MeshLink


class Membership:
    """This ranker's record in the mesh membership, kept under a lease from `join` until
    `leave` (or `close`), and the mesh's views followed meanwhile.

    Once left or closed, nothing more goes through it: `link` is None, `register` does
    nothing and `connected` is False (a closed etcd client, keeping nothing, would read as
    connected).
    """

    def __init__(self, link: MeshLink, instance_id: str, lease_ttl_s: float) -> None:
        self._link: MeshLink | None = link
        self.instance_id = instance_id
        self._lease_ttl_s = lease_ttl_s

    @property
    def link(self) -> MeshLink | None:
        """The mesh link while this ranker is in the mesh; None once it left."""
        return self._link

    def connected(self) -> bool:
        """Whether etcd is reachable through every watch and kept lease (False once left)."""
        return self._link is not None and self._link.etcd.connected

    async def join(self, record: RankerRecord) -> None:
        """Register `record`, then follow the peers' views: where a draining ranker hands its
        prefixes, whom a miss fetches from."""
        await self.register(record)
        if self._link is not None:
            await self._link.cluster.start()

    async def register(self, record: RankerRecord) -> None:
        """Publish `record` (again: a refitted cost model) under the lease; nothing once left."""
        if self._link is not None:
            await self._link.cluster.register(record, self._lease_ttl_s)

    async def leave(self) -> None:
        """Withdraw the registration (etcd down: the lease lapses by itself), then close."""
        if self._link is None:
            return
        with contextlib.suppress(Unavailable):
            await self._link.cluster.deregister(self.instance_id)
        await self.close()

    async def close(self) -> None:
        """Stop following the mesh without withdrawing: the registration lapses with its lease."""
        link, self._link = self._link, None
        if link is not None:
            await link.close()
