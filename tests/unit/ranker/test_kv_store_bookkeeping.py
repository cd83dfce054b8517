"""KV store bookkeeping: running pinned bytes, pin and time-to-live heaps, LRU order without
pinned entries, and random operations checked against a naive reference store."""

import numpy as np

from relaygr.behaviours import UserId
from services.ranker.keyed_heap import KeyedHeap
from services.ranker.kv_store import CacheKey, Drop, Tier

from .kv_reference import ReferenceStore
from .test_kv_store import VERSION, Fixture, key, kv_of


def pinned(f: Fixture) -> int:
    return f.store.usage(Tier.HBM).pinned_bytes


def test_pinned_bytes_follow_pin_consume_expiry_and_drop() -> None:
    f = Fixture(hbm=100, dram=100)
    f.store.put_device(key("a"), kv_of(10), pin_for=5.0)
    f.store.put_device(key("b"), kv_of(20), pin_for=None)
    assert pinned(f) == 10
    f.store.put_device(key("b"), kv_of(20), pin_for=3.0)  # pinning a resident entry
    f.store.put_device(key("b"), kv_of(20), pin_for=1.0)  # a shorter re-pin changes nothing
    assert pinned(f) == 30
    f.store.consume(key("a"))
    f.store.consume(key("a"))  # consuming twice releases once
    assert pinned(f) == 20 and f.store.stats.relays_consumed == 1
    f.clock.now += 3.0  # b's window ends
    f.store.expire()
    assert pinned(f) == 0 and f.store.stats.relays_expired_unconsumed == 1
    f.store.put_device(key("c"), kv_of(30), pin_for=2.0)
    f.store.put_device(key("a", "new"), kv_of(10), pin_for=2.0)  # supersedes unpinned a
    assert f.store.tier_of(key("a")) is None
    assert pinned(f) == 40
    f.store.consume(key("c"))
    f.store.put_device(key("c", "new"), kv_of(10), pin_for=None)  # supersedes c, now unpinned
    assert pinned(f) == 10
    assert f.store.stats.relays_dropped_unconsumed == 0


def test_a_re_pin_outlives_its_earlier_windows() -> None:
    f = Fixture()
    f.store.put_device(key("a"), kv_of(50), pin_for=2.0)  # ends at 1002
    f.clock.now += 1
    f.store.put_device(key("a"), kv_of(50), pin_for=5.0)  # extended to 1006
    f.clock.now = 1002.0
    assert not f.store.fits_device(51)  # the first window's end releases nothing
    f.store.consume(key("a"))
    f.store.put_device(key("a"), kv_of(50), pin_for=10.0)  # a new relay: ends at 1012
    f.clock.now = 1006.0  # the extended window's end, consumed since: releases nothing
    assert not f.store.fits_device(51)
    assert f.store.stats.relays_expired_unconsumed == 0
    f.clock.now = 1012.0
    assert f.store.fits_device(100)
    assert f.store.stats.relays_expired_unconsumed == 1


def test_pins_expire_by_window_end_not_by_pin_order() -> None:
    f = Fixture(hbm=100)
    for user, window in (("a", 9.0), ("b", 3.0), ("c", 6.0)):
        f.store.put_device(key(user), kv_of(20), pin_for=window)
    released = []
    for _ in range(9):
        f.clock.now += 1
        before = pinned(f)
        f.store.expire()
        if pinned(f) < before:
            released.append(f.clock.now - 1000)
    assert released == [3.0, 6.0, 9.0]


def test_eviction_skips_pinned_entries_and_a_released_pin_keeps_its_age() -> None:
    f = Fixture(hbm=90)
    f.store.put_device(key("a"), kv_of(30), pin_for=5.0)  # oldest, pinned
    f.store.put_device(key("b"), kv_of(30), pin_for=None)
    f.store.put_device(key("c"), kv_of(30), pin_for=None)
    f.store.put_device(key("d"), kv_of(30), pin_for=None)  # evicts b, not pinned a
    assert f.tiers()["a"] == Tier.HBM and f.tiers()["b"] == Tier.DRAM
    f.store.consume(key("a"))  # a is evictable again, and still the least recently used
    f.store.put_device(key("e"), kv_of(30), pin_for=None)
    assert f.tiers()["a"] == Tier.DRAM and f.tiers()["c"] == Tier.HBM
    f.store.put_device(key("f"), kv_of(30), pin_for=3.0)  # evicts c
    assert f.store.get(key("d"), Tier.HBM) is not None  # d used after f was stored
    f.clock.now += 3  # f's pin ends: it is older than d again
    f.store.put_device(key("g"), kv_of(30), pin_for=None)  # evicts e
    f.store.put_device(key("h"), kv_of(30), pin_for=None)  # evicts f
    assert f.tiers()["f"] == Tier.DRAM and f.tiers()["d"] == Tier.HBM
    assert f.store.stats.dropped[Tier.HBM, Drop.DEMOTED] == 5


def test_dram_entries_expire_in_storage_order_whatever_their_use() -> None:
    f = Fixture(hbm=100, dram=100, ttl=10.0)
    for user in "abc":
        f.store.put_host(key(user), kv_of(10))
        f.clock.now += 1
    assert f.store.get(key("a"), Tier.DRAM) is not None  # use does not refresh the ttl
    assert f.store.put_host(key("a"), kv_of(10))  # nor does storing it again
    f.clock.now = 1010.0
    f.store.expire()
    assert f.tiers() == {"a": None, "b": Tier.DRAM, "c": Tier.DRAM, "d": None, "e": None, "f": None}
    f.clock.now = 1012.0
    f.store.expire()
    assert f.store.usage(Tier.DRAM).entries == 0
    assert f.store.stats.dropped[Tier.DRAM, Drop.EXPIRED] == 3


def test_keyed_heap_orders_moves_and_stays_small() -> None:
    heap: KeyedHeap[str] = KeyedHeap()
    for k, p in (("a", 3.0), ("b", 1.0), ("c", 2.0), ("d", 2.0)):
        heap.set(k, p)
    heap.set("b", 5.0)  # moved behind the others
    heap.discard("c")
    assert heap.first() == "d" and len(heap) == 3 and "c" not in heap
    assert heap.pop_due(3.0) == ["d", "a"]
    assert heap.pop_due(4.0) == [] and heap.first() == "b"
    for i in range(10_000):
        heap.set("b", float(i))
    assert len(heap._heap) <= 2 * len(heap) + 33  # stale items are purged
    assert heap.pop_due(1e9) == ["b"] and heap.first() is None


def test_random_operations_match_a_naive_reference(rng: np.random.Generator) -> None:
    f = Fixture(hbm=600, dram=900, ttl=12.0)
    ref = ReferenceStore(600, 900, 12.0, f.clock)
    users = [f"u{i}" for i in range(25)]
    every_key = [key(u, d) for u in users for d in ("d0", "d1", "d2")]
    for step in range(4000):
        k = every_key[int(rng.integers(0, len(every_key)))]
        size = int(rng.integers(1, 200))
        # Half-second steps, so windows, ttls and clock readings often coincide exactly.
        window = float(rng.integers(0, 12)) / 2
        op = int(rng.integers(0, 9))
        if op == 0:
            assert f.store.put_device(k, kv_of(size), window) == ref.put_device(k, size, window)
        elif op == 1:
            assert f.store.put_device(k, kv_of(size), None) == ref.put_device(k, size, None)
        elif op == 2:
            assert f.store.put_host(k, kv_of(size)) == ref.put_host(k, size)
        elif op in (3, 4):
            tier = Tier.HBM if op == 3 else Tier.DRAM
            assert (f.store.get(k, tier) is not None) == ref.get(k, tier)
        elif op == 5:
            f.store.consume(k)
            ref.consume(k)
        elif op == 6:
            assert f.store.fits_device(size) == ref.fits_device(size)
        elif op == 7:
            f.store.expire()
            ref.expire()
        else:
            f.clock.now += float(rng.integers(0, 4)) / 2
        assert_same(f, ref, every_key, users, step)


def assert_same(
    f: Fixture, ref: ReferenceStore, every_key: list[CacheKey], users: list[str], step: int
) -> None:
    for tier in Tier:
        usage = f.store.usage(tier)
        assert (usage.used_bytes, usage.pinned_bytes, usage.entries) == (
            ref.used(tier),
            ref.pinned(tier),
            len(ref.tiers[tier]),
        ), f"step {step}: {tier} usage"
        held = {k for k in every_key if f.store.peek(k, tier) is not None}
        assert held == {e.key for e in ref.tiers[tier]}, f"step {step}: {tier} contents"
        for e in ref.tiers[tier]:
            entry = f.store.peek(e.key, tier)
            assert entry is not None and entry.pinned_until == e.pinned_until, f"step {step}"
    for user in users:
        assert f.store.user_keys(UserId(user), VERSION) == ref.user_keys(user), f"step {step}"
    assert f.store.stats == ref.stats, f"step {step}: stats"
