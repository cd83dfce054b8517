"""Whom a miss asks: the directory's holder always; the previous owner only while the fleet's
membership changed recently and asking has not shown the fleet cold (a settled or a cold fleet's
misses pay no round trip)."""

import torch

from relaygr.behaviours import UserId
from relaygr.cluster import MemoryCluster, PlacementRecord, RankerRecord
from relaygr.placement import ranking
from relaygr.pool import RankerPool
from relaygr.tls_settings import PLAINTEXT
from services.ranker.digest import PrefixDigest
from services.ranker.fetch_client import GrpcPeerSource
from services.ranker.kv_store import CacheKey
from services.ranker.model_config import PRESETS, ModelPreset
from services.ranker.peers import PreviousOwners
from services.ranker.prefix_kv import ModelVersion


def _record(name: str, version: str = "v1") -> RankerRecord:
    return RankerRecord(
        name, f"127.0.0.1:{5000 + int(name[-1])}", version, 1, 1, 1, 0.0, 0.0, 0.0, 0.0, 0.0
    )


async def test_the_previous_owner_is_asked_only_within_the_window_after_a_change() -> None:
    cluster = MemoryCluster(clock=lambda: 0.0)
    for name in ("r0", "r1", "r2"):
        await cluster.register(_record(name), ttl_s=5)
    await cluster.register(_record("r3", "v2"), ttl_s=5)
    user = "user-7"
    me = ranking(user, ["r0", "r1", "r2"])[0]
    previous = ranking(user, [i for i in ("r0", "r1", "r2") if i != me])[0]
    now = [100.0]
    source = GrpcPeerSource(
        RankerPool([], PLAINTEXT),  # never dialled: peers() only reads the views
        cluster.view,
        cluster,
        me,
        PRESETS[ModelPreset.TINY],
        torch.device("cpu"),
        PreviousOwners(window_s=30.0),
        changed_at=lambda: 90.0,
        clock=lambda: now[0],
    )
    key = CacheKey(UserId(user), ModelVersion("v1"), PrefixDigest("d"))
    assert [(p.instance_id, p.previous_owner) for p in source.peers(key)] == [(previous, True)]
    now[0] = 121.0  # settled: the owner cannot have moved since
    assert source.peers(key) == []
    # The directory's holder is asked whatever the time, and first.
    holder = next(i for i in ("r0", "r1", "r2") if i not in (me, previous))
    await cluster.record(PlacementRecord(user, holder, 1e9, "v1"), holder)
    assert [(p.instance_id, p.previous_owner) for p in source.peers(key)] == [(holder, False)]
    now[0] = 100.0
    assert [p.instance_id for p in source.peers(key)] == [holder, previous]
    # Only rankers of the key's version, never itself.
    other = CacheKey(UserId(user), ModelVersion("v2"), PrefixDigest("d"))
    assert [p.instance_id for p in source.peers(other)] == ["r3"]
    assert me not in [p.instance_id for p in source.peers(key)]


def test_previous_owners_are_asked_until_the_fleet_shows_itself_cold() -> None:
    owners = PreviousOwners(window_s=30.0, cold_asks=3)
    # A fleet that started together: three asks found nothing, so asking stops.
    for _ in range(3):
        assert owners.asking(now=101.0, changed_at=100.0)
        owners.answered(found=False)
    assert not owners.asking(now=102.0, changed_at=100.0)
    # The next change asks again; once an ask has found an entry, misses ask all the window.
    assert owners.asking(now=140.0, changed_at=139.0)
    owners.answered(found=True)
    for _ in range(10):
        owners.answered(found=False)
        assert owners.asking(now=150.0, changed_at=139.0)
    assert not owners.asking(now=169.0, changed_at=139.0)  # the window ended
