"""KV store tiers: exact LRU order, pins, expiry, demotion and budgets under an injected clock."""

import numpy as np
import pytest
import torch

from relaygr.behaviours import UserId
from services.ranker.digest import PrefixDigest, PrefixHasher
from services.ranker.kv_store import CacheKey, Drop, KVStore, Tier
from services.ranker.prefix_kv import ModelVersion, PrefixKV

VERSION = ModelVersion("hstu-test")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kv_of(nbytes: int) -> PrefixKV:
    """A PrefixKV occupying exactly `nbytes` (one byte per token)."""
    return PrefixKV(
        keys=torch.zeros(1, 1, nbytes, 1, dtype=torch.uint8),
        values=torch.zeros(1, 1, nbytes, 0),
        timestamps=torch.zeros(0, dtype=torch.int64),
        num_user_tokens=0,
        hasher=PrefixHasher.start(np.zeros(0, np.int64)),
        model_version=VERSION,
    )


def key(user: str, digest: str = "d0") -> CacheKey:
    return CacheKey(UserId(user), VERSION, PrefixDigest(digest))


class Fixture:
    def __init__(self, hbm: int = 100, dram: int = 100, ttl: float = 60.0) -> None:
        self.clock = Clock()
        self.copies: list[int] = []
        self.store = KVStore(hbm, dram, ttl, self.clock, self._to_host)

    def _to_host(self, kv: PrefixKV) -> PrefixKV:
        self.copies.append(kv.nbytes)
        return kv

    def tiers(self) -> dict[str, Tier | None]:
        return {u: self.store.tier_of(key(u)) for u in "abcdef"}


def test_unpinned_entries_leave_hbm_least_recently_used_first_into_dram() -> None:
    f = Fixture()
    for user in "abc":
        assert f.store.put_device(key(user), kv_of(30), pin_for=None)
        f.clock.now += 1
    assert f.store.get(key("a"), Tier.HBM) is not None  # a is now the most recent
    assert f.store.put_device(key("d"), kv_of(30), pin_for=None)
    assert f.tiers() == {
        "a": Tier.HBM,
        "b": Tier.DRAM,
        "c": Tier.HBM,
        "d": Tier.HBM,
        "e": None,
        "f": None,
    }
    assert f.store.put_device(key("e"), kv_of(50), pin_for=None)  # needs two victims: c, then a
    assert f.tiers()["c"] == f.tiers()["a"] == Tier.DRAM
    assert f.copies == [30, 30, 30]
    assert f.store.stats.dropped[Tier.HBM, Drop.DEMOTED] == 3


def test_pinned_entries_are_never_evicted_and_refusal_changes_nothing() -> None:
    f = Fixture()
    assert f.store.put_device(key("a"), kv_of(40), pin_for=5.0)
    assert f.store.put_device(key("b"), kv_of(40), pin_for=5.0)
    assert not f.store.fits_device(30)
    assert not f.store.put_device(key("c"), kv_of(30), pin_for=None)
    assert f.tiers()["c"] is None and f.store.usage(Tier.HBM).used_bytes == 80
    assert f.store.put_device(key("c"), kv_of(20), pin_for=None)
    assert f.store.usage(Tier.HBM).pinned_bytes == 80
    assert f.store.stats.hbm_rejected == 1


def test_relay_window_expiry_and_consumption_release_pins() -> None:
    f = Fixture()
    f.store.put_device(key("a"), kv_of(50), pin_for=5.0)
    f.store.put_device(key("b"), kv_of(50), pin_for=10.0)
    f.clock.now += 4.999
    assert not f.store.fits_device(1)
    f.clock.now += 0.001  # a's window ends exactly now
    assert f.store.fits_device(50) and not f.store.fits_device(51)
    assert f.store.stats.relays_expired_unconsumed == 1
    f.store.consume(key("b"))
    assert f.store.fits_device(100)
    assert f.store.stats.relays_consumed == 1
    assert f.store.stats.relays_expired_unconsumed == 1  # consumed is not expired


def test_repinning_a_resident_key_extends_its_window() -> None:
    f = Fixture()
    f.store.put_device(key("a"), kv_of(50), pin_for=5.0)
    f.clock.now += 4
    assert f.store.put_device(key("a"), kv_of(50), pin_for=5.0)
    f.clock.now += 4
    assert f.store.usage(Tier.HBM).pinned_bytes == 50


def test_dram_entries_expire_and_evict_lru() -> None:
    f = Fixture(hbm=100, dram=60, ttl=30.0)
    for user in "abc":
        f.store.put_host(key(user), kv_of(25))
        f.clock.now += 10
    assert f.tiers()["a"] is None  # evicted LRU to fit c
    assert f.tiers()["b"] == f.tiers()["c"] == Tier.DRAM
    f.clock.now += 0  # b stored at 1010, c at 1020; now 1030 -> b expires at 1040
    f.clock.now = 1040.0
    f.store.expire()
    assert f.tiers()["b"] is None and f.tiers()["c"] == Tier.DRAM
    assert f.store.stats.dropped[Tier.DRAM, Drop.EXPIRED] == 1
    assert f.store.stats.dropped[Tier.DRAM, Drop.EVICTED] == 1
    assert not f.store.put_host(key("d"), kv_of(61))
    assert f.store.stats.dropped[Tier.DRAM, Drop.TOO_LARGE] == 1


def test_a_new_prefix_supersedes_the_users_old_one_in_both_tiers() -> None:
    f = Fixture()
    f.store.put_host(key("a", "old"), kv_of(10))
    f.store.put_device(key("a", "old"), kv_of(10), pin_for=None)
    assert f.store.user_keys(UserId("a"), VERSION) == [key("a", "old")]
    f.store.put_device(key("a", "new"), kv_of(20), pin_for=1.0)
    assert f.store.tier_of(key("a", "old")) is None
    assert f.store.user_keys(UserId("a"), VERSION) == [key("a", "new")]
    assert (
        f.store.stats.dropped[Tier.HBM, Drop.SUPERSEDED]
        == f.store.stats.dropped[Tier.DRAM, Drop.SUPERSEDED]
        == 1
    )


def test_a_pending_relay_survives_a_newer_prefix_of_the_same_user() -> None:
    f = Fixture()
    f.store.put_device(key("a", "relayed"), kv_of(10), pin_for=5.0)
    assert f.store.put_device(key("a", "newer"), kv_of(10), pin_for=None)
    assert f.store.tier_of(key("a", "relayed")) is Tier.HBM  # its Rank still finds it
    assert f.store.user_keys(UserId("a"), VERSION) == [key("a", "newer"), key("a", "relayed")]
    f.store.consume(key("a", "relayed"))
    assert f.store.put_device(key("a", "newest"), kv_of(10), pin_for=None)
    assert f.store.user_keys(UserId("a"), VERSION) == [key("a", "newest")]


def test_demoting_an_entry_dram_already_holds_copies_nothing() -> None:
    f = Fixture()
    f.store.put_host(key("a"), kv_of(60))
    f.store.put_device(key("a"), kv_of(60), pin_for=None)  # reloaded copy
    f.store.put_device(key("b"), kv_of(60), pin_for=None)
    assert f.copies == []
    assert f.tiers()["a"] == Tier.DRAM


def test_budgets_hold_under_random_operations(rng: np.random.Generator) -> None:
    f = Fixture(hbm=1000, dram=1500, ttl=20.0)
    for _ in range(3000):
        user = f"u{int(rng.integers(0, 30))}"
        op = int(rng.integers(0, 5))
        digest = f"d{int(rng.integers(0, 2))}"
        size = int(rng.integers(1, 400))
        if op == 0:
            f.store.put_device(key(user, digest), kv_of(size), pin_for=float(rng.uniform(0, 10)))
        elif op == 1:
            f.store.put_device(key(user, digest), kv_of(size), pin_for=None)
        elif op == 2:
            f.store.put_host(key(user, digest), kv_of(size))
        elif op == 3:
            f.store.consume(key(user, digest))
        else:
            f.clock.now += float(rng.uniform(0, 3))
        for tier in Tier:
            usage = f.store.usage(tier)
            assert usage.used_bytes <= usage.budget_bytes
            entries = f.store._tiers[tier].entries.values()
            assert usage.used_bytes == sum(e.nbytes for e in entries)
        for (user_id, _), keys in f.store._by_user.items():
            assert keys and len(set(keys)) == len(keys)
            assert all(k.user_id == user_id and f.store.tier_of(k) is not None for k in keys)
        for tier in Tier:  # every held prefix is indexed under its user
            for k in f.store._tiers[tier].entries:
                assert k in f.store.user_keys(k.user_id, VERSION)


def test_a_rank_times_its_relay_from_the_latest_pin_once_even_after_the_pin_ended() -> None:
    f = Fixture()
    assert f.store.put_device(key("a"), kv_of(10), pin_for=0.5)
    assert f.store.put_device(key("b"), kv_of(10), pin_for=None)  # not a relay
    f.clock.now += 0.2
    assert f.store.put_device(key("a"), kv_of(10), pin_for=0.5)  # pinned again: from here
    f.clock.now += 0.7  # past the pin's end: a late Rank is still timed
    f.store.expire()
    assert f.store.rank_arrived(key("a")) == pytest.approx(0.7)
    assert f.store.rank_arrived(key("a")) is None  # the relay is timed once
    assert f.store.rank_arrived(key("b")) is None
    assert f.store.rank_arrived(key("c")) is None  # not held
