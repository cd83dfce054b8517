"""Cluster ports: record JSON round trips and validation, MemoryCluster membership and directory."""

import asyncio
import dataclasses
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from relaygr.cluster import Directory, Membership, MemoryCluster, PlacementRecord, RankerRecord
from relaygr.errors import InvalidInput

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def ranker(instance_id: str = "ranker-0", **overrides: Any) -> RankerRecord:
    values: dict[str, Any] = dict(
        instance_id=instance_id,
        address="10.0.0.7:50051",
        model_version="mv-1a2b",
        hbm_budget_bytes=8 * 2**30,
        dram_budget_bytes=64 * 2**30,
        kv_bytes_per_token=24_576,
        fixed_ms=1.5,
        per_token_ms=0.002,
        per_pair_ms=1e-7,
        per_candidate_key_ms=3e-6,
        reload_ms_per_mb=0.05,
    )
    values.update(overrides)
    return RankerRecord(**values)


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- records -------------------------------------------------------------------------------


def test_ranker_record_round_trips() -> None:
    record = ranker()
    assert RankerRecord.from_json(record.to_json()) == record
    assert json.loads(record.to_json())["address"] == "10.0.0.7:50051"


def test_ranker_record_accepts_ints_for_floats_ipv6_and_unknown_keys() -> None:
    raw = json.loads(ranker(address="[::1]:7000").to_json())
    raw.update(fixed_ms=2, added_in_a_later_version=True)
    record = RankerRecord.from_json(json.dumps(raw).encode())
    assert record.fixed_ms == 2.0 and isinstance(record.fixed_ms, float)
    assert record.address == "[::1]:7000"


def test_placement_record_round_trips() -> None:
    record = PlacementRecord("alice", "ranker-3", 1_700_000_030.25)
    assert PlacementRecord.from_json(record.to_json()) == record


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b"{}", "missing fields instance_id, address"),
    ],
)
def test_malformed_json_is_invalid_input(data: bytes, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        RankerRecord.from_json(data)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("instance_id", "", "instance_id must be a non-empty string"),
        ("model_version", 7, "model_version must be a non-empty string"),
        ("address", "10.0.0.7", "host:port"),
        ("address", ":50051", "host:port"),
        ("address", "h:0", "host:port"),
        ("address", "h:70000", "host:port"),
        ("address", "h:http", "host:port"),
        ("hbm_budget_bytes", -1, "hbm_budget_bytes must be a non-negative integer"),
        ("dram_budget_bytes", 1.5, "dram_budget_bytes must be a non-negative integer"),
        ("kv_bytes_per_token", True, "kv_bytes_per_token must be a non-negative integer"),
        ("per_pair_ms", "0.1", "per_pair_ms must be a finite number"),
        ("per_token_ms", None, "per_token_ms must be a finite number"),
        ("per_candidate_key_ms", 10**400, "per_candidate_key_ms must be a finite number"),
        ("reload_ms_per_mb", -0.5, "reload_ms_per_mb must be non-negative"),
    ],
)
def test_bad_ranker_field_is_invalid_input(field: str, value: object, message: str) -> None:
    raw = json.loads(ranker().to_json())
    raw[field] = value
    with pytest.raises(InvalidInput, match=message):
        RankerRecord.from_json(json.dumps(raw).encode())


def test_non_finite_numbers_are_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="fixed_ms must be a finite number"):
        RankerRecord.from_json(ranker().to_json().replace(b'"fixed_ms":1.5', b'"fixed_ms":NaN'))
    with pytest.raises(InvalidInput, match="expires_at must be a finite number"):
        PlacementRecord.from_json(b'{"user_id":"a","instance_id":"r","expires_at":Infinity}')
    with pytest.raises(InvalidInput, match="user_id must be a non-empty string"):
        PlacementRecord.from_json(b'{"user_id":"","instance_id":"r","expires_at":1}')


def test_records_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ranker().address = "elsewhere:1"  # type: ignore[misc]


# -- MemoryCluster -------------------------------------------------------------------------


def test_memory_cluster_implements_both_ports() -> None:
    cluster = MemoryCluster(FakeClock())
    membership: Membership = cluster
    directory: Directory = cluster
    assert membership.view() == {} and directory.lookup("alice", "") is None


def test_membership_register_replace_deregister_and_snapshot_views() -> None:
    cluster = MemoryCluster(FakeClock())
    run(cluster.register(ranker("r0"), ttl_s=10))
    first = cluster.view()
    run(cluster.register(ranker("r1"), ttl_s=10))
    run(cluster.register(ranker("r0", model_version="mv-new"), ttl_s=10))
    assert sorted(cluster.view()) == ["r0", "r1"]
    assert cluster.view()["r0"].model_version == "mv-new"
    assert dict(first) == {"r0": ranker("r0")}  # an earlier view is unchanged
    run(cluster.deregister("r0"))
    run(cluster.deregister("never-registered"))
    assert list(cluster.view()) == ["r1"]
    with pytest.raises(TypeError):
        cluster.view()["r2"] = ranker("r2")  # type: ignore[index]
    with pytest.raises(InvalidInput, match="ttl_s must be positive"):
        run(cluster.register(ranker("r2"), ttl_s=0))


def test_directory_entry_expires_exactly_at_expires_at() -> None:
    clock = FakeClock(100.0)
    cluster = MemoryCluster(clock)
    run(cluster.register(ranker("r1"), ttl_s=10))
    assert run(cluster.record(PlacementRecord("alice", "r1", 130.0), "r1"))
    clock.now = 129.999
    assert cluster.lookup("alice", "") == "r1"
    clock.now = 130.0
    assert cluster.lookup("alice", "") is None
    clock.now = 100.0  # an expired entry is gone, not hidden
    assert cluster.lookup("alice", "") is None


def test_directory_latest_record_wins_and_needs_a_live_holder() -> None:
    cluster = MemoryCluster(FakeClock(0.0))
    run(cluster.register(ranker("r1"), ttl_s=10))
    run(cluster.register(ranker("r2"), ttl_s=10))
    assert run(cluster.record(PlacementRecord("alice", "r1", 60.0), "r1"))
    assert run(cluster.record(PlacementRecord("alice", "r2", 60.0), "r2"))
    assert cluster.lookup("alice", "") == "r2"
    assert not run(cluster.record(PlacementRecord("bob", "r9", 60.0), "r9"))
    assert cluster.lookup("bob", "") is None


def test_deregister_drops_entries_held_by_or_placed_on_the_instance() -> None:
    cluster = MemoryCluster(FakeClock(0.0))
    for r in ("r1", "r2", "r3"):
        run(cluster.register(ranker(r), ttl_s=10))
    run(cluster.record(PlacementRecord("alice", "r1", 60.0), "r1"))
    run(cluster.record(PlacementRecord("bob", "r1", 60.0), "r2"))  # placed on r1, held by r2
    run(cluster.record(PlacementRecord("carol", "r2", 60.0), "r1"))  # held by r1
    run(cluster.record(PlacementRecord("dave", "r3", 60.0), "r3"))
    run(cluster.deregister("r1"))
    assert [cluster.lookup(u, "") for u in ("alice", "bob", "carol", "dave")] == [
        None,
        None,
        None,
        "r3",
    ]
    run(cluster.forget_instance("r3"))
    assert cluster.lookup("dave", "") is None
    assert sorted(cluster.view()) == ["r2", "r3"]  # forgetting entries leaves membership alone


def test_directory_entries_are_namespaced_by_model_version() -> None:
    cluster = MemoryCluster(FakeClock(0.0))
    for r in ("r1", "r2"):
        run(cluster.register(ranker(r), ttl_s=10))
    assert run(cluster.record(PlacementRecord("alice", "r1", 60.0, "v1"), "r1"))
    assert run(cluster.record(PlacementRecord("alice", "r2", 60.0, "v2"), "r2"))
    assert (cluster.lookup("alice", "v1"), cluster.lookup("alice", "v2")) == ("r1", "r2")
    assert cluster.lookup("alice", "") is None and cluster.entry("alice", "v3") is None
    assert cluster.entry("alice", "v2") == PlacementRecord("alice", "r2", 60.0, "v2")
    run(cluster.forget_instance("r2"))
    assert (cluster.lookup("alice", "v1"), cluster.lookup("alice", "v2")) == ("r1", None)


def test_a_placement_record_without_a_version_parses_and_a_version_has_no_slash() -> None:
    older = b'{"expires_at": 5, "instance_id": "r1", "user_id": "alice"}'
    assert PlacementRecord.from_json(older) == PlacementRecord("alice", "r1", 5.0, "")
    record = PlacementRecord("alice", "r1", 5.0, "v1")
    assert PlacementRecord.from_json(record.to_json()) == record
    with pytest.raises(InvalidInput, match="model_version must not contain '/'"):
        PlacementRecord("alice", "r1", 5.0, "v/1")
    with pytest.raises(InvalidInput, match="model_version must not contain '/'"):
        ranker(model_version="v/1")
    with pytest.raises(InvalidInput, match="user_id must be a non-empty string"):
        PlacementRecord("", "r1", 5.0, "v1")
