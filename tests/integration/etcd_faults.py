"""A real etcd client with faults injected on demand, for the tests of leases and membership."""

from relaygr.etcd.client import EtcdClient
from relaygr.etcd.lease import Lease


class Flaky(EtcdClient):
    """A real etcd client with faults on demand. Its next keepalive, once asked, refreshes the
    lease for real and then fails: `forget_next` answers "lease unknown" (as if etcd expired it),
    `raise_next` raises the error given. `delete_after_put` puts of a key, once asked, each land
    and are then deleted (by someone else, say) before the put returns."""

    def __init__(self, endpoints: list[str]) -> None:
        super().__init__(endpoints)
        self.forget_next = False
        self.raise_next: BaseException | None = None
        self.refreshed = 0
        self.delete_after_put: tuple[str, int] | None = None  # the key, and how many puts
        self.deleted_after_put = 0

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

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        revision = await super().put(key, value, lease)
        if self.delete_after_put is not None and self.delete_after_put[0] == key:
            remaining = self.delete_after_put[1] - 1
            self.delete_after_put = (key, remaining) if remaining else None
            await super().delete(key)
            self.deleted_after_put += 1
        return revision
