"""The etcd-backed directory holds the names its entries repeat (ranker ids, model versions)
once each, and keeps at most a bounded number of them, whatever names arrive."""

from relaygr.cluster import PlacementRecord
from relaygr.etcd.client import EtcdClient
from relaygr.etcd.membership_directory import _NAMES_KEPT, EtcdMembershipDirectory, entry_value
from relaygr.etcd.watch import EventKind, WatchEvent


def fed(names: int) -> EtcdMembershipDirectory:
    """A directory (never connected) fed one entry per name, as its watch would deliver them."""
    directory = EtcdMembershipDirectory(EtcdClient(["127.0.0.1:1"]))
    for i in range(names):
        placement = PlacementRecord(f"user-{i}", f"ranker-{i}", 10.0, "v1")
        key = directory._directory_key(("v1", placement.user_id))
        value = entry_value(placement, f"holder-{i}")
        directory._on_directory_event(WatchEvent(EventKind.PUT, key, value, i + 1))
    return directory


def test_names_kept_for_sharing_stay_bounded_whatever_the_names() -> None:
    directory = fed(_NAMES_KEPT + 500)  # every entry names a ranker and a holder never seen
    assert len(directory._names) == _NAMES_KEPT
    assert len(directory._entries) == _NAMES_KEPT + 500, "every entry is still kept"
