"""A real etcd client with faults injected on demand, for the tests of leases and membership."""

from relaygr.etcd.client import EtcdClient
from relaygr.etcd.lease import Lease


class Flaky(EtcdClient):
    """A real etcd client whose next keepalive, when asked, first refreshes the lease for real
    and then fails: `forget` answers "lease unknown" (etcd expired it), `raise_` raises it."""

    def __init__(self, endpoints: list[str]) -> None:
        super().__init__(endpoints)
        self.forget_next = False
        self.raise_next: BaseException | None = None
        self.refreshed = 0

    async def refresh_lease(self, lease: Lease) -> bool:
        alive = await super().refresh_lease(lease)
        self.refreshed += 1
        if self.raise_next is not None:
            err, self.raise_next = self.raise_next, None
            raise err
        if self.forget_next:
            self.forget_next = False
            return False
        return alive
