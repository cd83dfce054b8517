"""Hand-off on drain without a server: what goes first, how fast and for how long, where each
prefix lands on the receiver, and that nothing refused is ever served."""

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from relaygr.cluster import RankerRecord
from relaygr.placement import ranking
from services.ranker.engine import CacheOutcome
from services.ranker.handoff import (
    Bandwidth,
    HandoffFailed,
    HandoffSender,
    HandoffSettings,
    HandoffStats,
    Piece,
    Receipt,
    Target,
    plan,
)
from services.ranker.handoff_intake import HandoffIntake
from services.ranker.handoff_order import Candidate, StoreHolder, value_order
from services.ranker.kv_store import CacheKey, KVStore, Tier
from services.ranker.model import RankingModel
from services.ranker.prefix_kv import PrefixKV
from services.ranker.transfer import EntryHeader, Refusal, chunks, encode
from tests.unit.ranker.factories import prefix, rank_input, rel_err, tiny_config
from tests.unit.ranker.test_engine import KV_BYTES, MODEL, TOKENS, Clock, running_engine


def _key(user: str, digest: str = "d") -> CacheKey:
    return CacheKey(user, "mv", digest)  # type: ignore[arg-type]


def _record(instance_id: str, version: str = MODEL.model_version) -> RankerRecord:
    return RankerRecord(
        instance_id=instance_id, address=f"{instance_id}.ranker:50051",
        model_version=version, hbm_budget_bytes=1, dram_budget_bytes=1, kv_bytes_per_token=1,
        fixed_ms=1.0, per_token_ms=0.0, per_pair_ms=0.0, per_candidate_key_ms=0.0,
        reload_ms_per_mb=0.0,
    )  # fmt: skip


def _store(clock: Clock, hbm_prefixes: float, dram_prefixes: float) -> KVStore[PrefixKV]:
    return KVStore(
        int(hbm_prefixes * KV_BYTES), int(dram_prefixes * KV_BYTES), dram_ttl=600.0, clock=clock,
        to_host=lambda kv: kv.to("cpu"),
    )  # fmt: skip


def _prefill(rng: np.random.Generator, user: str, model: RankingModel = MODEL) -> tuple[Any, Any]:
    p = prefix(rng, TOKENS, user_id=user)
    kv = model.prefill(p)
    return p, (CacheKey(p.user_id, model.model_version, kv.digest), kv)


def _intake(store: KVStore[PrefixKV], stats: HandoffStats, computing=lambda _: False):  # type: ignore[no-untyped-def]
    return HandoffIntake(
        StoreHolder(store, computing), MODEL.cfg, MODEL.model_version, MODEL.device, stats
    )


def _feed(intake: HandoffIntake, header: EntryHeader, payload: bytes) -> None:
    intake.header(header)
    for piece in chunks(payload, 4096):
        intake.data(bytes(piece))


# -- what goes first, and to whom ----------------------------------------------------------


def test_value_order_is_due_relays_then_recent_device_entries_then_recent_host_copies() -> None:
    c = [
        Candidate(_key("dram-old"), Tier.DRAM, 1, None, 3),
        Candidate(_key("hbm-old"), Tier.HBM, 1, None, 5),
        Candidate(_key("pinned-late"), Tier.HBM, 1, 30.0, 1),
        Candidate(_key("dram-new"), Tier.DRAM, 1, None, 9),
        Candidate(_key("hbm-new"), Tier.HBM, 1, None, 8),
        Candidate(_key("pinned-soon"), Tier.HBM, 1, 10.0, 2),
        Candidate(_key("hbm-new"), Tier.DRAM, 1, None, 10),  # its host copy: sent once, from HBM
    ]
    ordered = value_order(c)
    assert [x.key.user_id for x in ordered] == [
        "pinned-soon", "pinned-late", "hbm-new", "hbm-old", "dram-new", "dram-old",
    ]  # fmt: skip
    assert ordered[2].tier is Tier.HBM


def test_each_prefix_goes_to_the_owner_of_its_user_once_the_drainer_is_gone() -> None:
    view = {i: _record(i, "mv") for i in ("r0", "r1", "r2")} | {"r3": _record("r3", "other")}
    users = [f"u{i}" for i in range(40)]
    ordered = [Candidate(_key(u), Tier.HBM, 1, None, -i) for i, u in enumerate(users)]
    routes = plan(ordered, view, "r0", "mv", max_entries=30)
    assert {t.instance_id for t in routes} == {"r1", "r2"}  # never self, never another version
    for target, entries in routes.items():
        assert target.address == view[target.instance_id].address
        for c in entries:
            assert ranking(c.key.user_id, ["r1", "r2"])[0] == target.instance_id
        assert entries == sorted(entries, key=lambda c: -c.last_use)  # value order kept
    assert sum(len(e) for e in routes.values()) == 30  # at most max_entries
    assert plan(ordered, {"r0": view["r0"]}, "r0", "mv", 30) == {}  # nobody to take them


def test_bandwidth_books_bytes_back_to_back_at_the_rate() -> None:
    clock = Clock()
    bw = Bandwidth(100.0, clock)
    assert bw.reserve(50) == 0.0
    assert bw.reserve(100) == 0.5  # after the first 50 bytes
    clock.now += 0.25
    assert bw.reserve(10) == 1.25  # behind 1.5 s of booked bytes, a quarter of which passed
    assert bw.done_at(100) == clock.now + 1.35 + 1.0
    clock.now += 10
    assert bw.reserve(10) == 0.0  # idle: no debt carried


# -- the sender, through a port that feeds a real receiving store ----------------------------


class IntakePort:
    """Streams straight into receiving stores (one per target); `fail` names targets whose
    stream breaks after its first entry's header."""

    def __init__(self, stores: dict[str, KVStore[PrefixKV]], fail: frozenset[str] = frozenset()):
        self.stores, self.fail = stores, fail
        self.stats = HandoffStats()
        self.timeouts: dict[str, float] = {}

    async def send(self, target: Target, pieces: AsyncIterator[Piece], timeout_s: float) -> Receipt:
        self.timeouts[target.instance_id] = timeout_s
        intake = _intake(self.stores[target.instance_id], self.stats)
        async for piece in pieces:
            if isinstance(piece, EntryHeader):
                if target.instance_id in self.fail:
                    intake.abandon()
                    raise HandoffFailed("UNAVAILABLE: connection reset")
                intake.header(piece)
            else:
                intake.data(bytes(piece))
        r = intake.end()
        return Receipt(r.admitted, r.refused, r.admitted_bytes, tuple(r.refusals))


def _sender(
    store: KVStore[PrefixKV], port: IntakePort, clock: Clock, budget_s: float, rate: float
) -> HandoffSender:
    async def sleep(seconds: float) -> None:
        clock.now += seconds

    settings = HandoffSettings(budget_s, rate, max_entries=1000, chunk_bytes=KV_BYTES // 4 + 1)
    return HandoffSender(
        StoreHolder(store),
        port,
        settings,
        HandoffStats(),
        clock=clock,
        sleep=sleep,
        encode_in_thread=False,
    )


async def test_a_drain_sends_the_most_recent_prefixes_that_fit_its_time_budget(
    rng: np.random.Generator,
) -> None:
    clock = Clock()
    sender, receiver = _store(clock, 8, 0), _store(clock, 8, 8)
    keys = []
    for i in range(5):
        _, (key, kv) = _prefill(rng, f"u{i}")
        assert sender.put_device(key, kv, pin_for=None)
        keys.append(key)
    view = {"me": _record("me"), "next": _record("next")}
    port = IntakePort({"next": receiver})
    # One prefix a second: within 2.5 s the two most recently used go; the rest do not fit.
    handoff = _sender(sender, port, clock, budget_s=2.5, rate=float(KV_BYTES))
    start = clock.now
    (outcome,) = await handoff.hand_off(view, "me", MODEL.model_version, budget_s=10.0)
    assert (outcome.entries, outcome.nbytes) == (2, 2 * KV_BYTES)
    assert outcome.receipt == Receipt(2, 0, 2 * KV_BYTES)
    assert port.timeouts["next"] == 2.5  # the call's own deadline: the budget left
    assert receiver.usage(Tier.HBM).entries == 2
    for key in keys[3:]:  # the newest two
        held = receiver.peek(key, Tier.HBM)
        assert held is not None and not held.pinned
    assert all(receiver.tier_of(k) is None for k in keys[:3])
    # The bound, exactly: the last piece starts once 2 prefixes less itself went at the rate.
    last_piece = KV_BYTES - 3 * (KV_BYTES // 4 + 1)
    assert clock.now - start == pytest.approx(2.0 - last_piece / KV_BYTES)
    stats = handoff.stats
    assert (stats.sent_entries, stats.sent_bytes, stats.unsent_entries) == (2, 2 * KV_BYTES, 3)
    assert port.stats.admitted[Tier.HBM] == 2


async def test_a_failing_target_ends_only_its_own_stream(rng: np.random.Generator) -> None:
    clock = Clock()
    sender = _store(clock, 40, 0)
    view = {i: _record(i) for i in ("me", "r1", "r2")}
    users = {"r1": 0, "r2": 0}
    for i in range(30):
        _, (key, kv) = _prefill(rng, f"u{i}")
        sender.put_device(key, kv, pin_for=None)
        users[ranking(key.user_id, ["r1", "r2"])[0]] += 1
    assert min(users.values()) > 0
    stores = {"r1": _store(clock, 40, 0), "r2": _store(clock, 40, 0)}
    port = IntakePort(stores, fail=frozenset({"r1"}))
    handoff = _sender(sender, port, clock, budget_s=5.0, rate=1e12)
    outcomes = {
        o.target.instance_id: o for o in await handoff.hand_off(view, "me", MODEL.model_version)
    }
    assert outcomes["r1"].receipt is None and "UNAVAILABLE" in outcomes["r1"].error
    assert outcomes["r2"].receipt == Receipt(users["r2"], 0, users["r2"] * KV_BYTES)
    assert stores["r1"].usage(Tier.HBM).entries == 0  # the partial entry was never stored
    assert stores["r2"].usage(Tier.HBM).entries == users["r2"]
    assert handoff.stats.failed_streams == 1
    assert handoff.stats.unsent_entries == users["r1"]
    assert port.stats.refused[Refusal.CORRUPT] == 0  # cut between header and data: not counted


# -- admission on the receiver ---------------------------------------------------------------


def test_received_prefixes_take_free_or_idle_room_and_never_what_is_in_use(
    rng: np.random.Generator,
) -> None:
    clock = Clock()
    store = _store(clock, 2, 2)
    idle = [_prefill(rng, f"idle{i}")[1] for i in range(3)]
    for key, kv in idle[:2]:
        store.put_device(key, kv, pin_for=None)
    store.put_host(*idle[2])
    stats = HandoffStats()
    intake = _intake(store, stats)  # the hand-off begins: what is used from now on is spared
    sent = [encode(*_prefill(rng, f"new{i}")[1]) for i in range(3)]
    # HBM is full of entries idle since before the hand-off: the least recent is demoted.
    _feed(intake, *sent[0])
    store.get(idle[1][0], Tier.HBM)  # the other is used now by this ranker's own traffic
    # HBM holds nothing idle now: DRAM, where the idle host copy makes room.
    _feed(intake, *sent[1])
    # No room left that is idle: refused rather than displace what is in use or was received.
    _feed(intake, *sent[2])
    _feed(intake, *sent[0])  # a key held already: counted admitted, stored once
    report = intake.end()
    where = {
        name: store.tier_of(key)
        for name, key in [
            ("idle0", idle[0][0]), ("idle1", idle[1][0]), ("idle2", idle[2][0]),
            ("new0", sent[0][0].key), ("new1", sent[1][0].key), ("new2", sent[2][0].key),
        ]
    }  # fmt: skip
    assert where == {
        "idle0": Tier.DRAM, "idle1": Tier.HBM, "idle2": None,
        "new0": Tier.HBM, "new1": Tier.DRAM, "new2": None,
    }  # fmt: skip
    assert (report.admitted, report.refused, report.refusals) == (3, 1, ["new2: no_room"])
    assert report.admitted_bytes == 3 * KV_BYTES
    assert (stats.admitted[Tier.HBM], stats.admitted[Tier.DRAM]) == (2, 1)
    assert stats.refused[Refusal.NO_ROOM] == 1
    for tier in Tier:
        u = store.usage(tier)
        assert u.used_bytes <= u.budget_bytes
    assert not any(e.pinned for t in Tier for e in store.entries(t))


def test_pinned_relays_are_never_displaced_and_a_user_keeps_its_own_prefix(
    rng: np.random.Generator,
) -> None:
    clock = Clock()
    store = _store(clock, 1, 0)
    _, (mine, kv) = _prefill(rng, "pinned")
    store.put_device(mine, kv, pin_for=30.0)
    stats = HandoffStats()
    intake = _intake(store, stats, computing=lambda key: key.user_id == "busy")
    _feed(intake, *encode(*_prefill(rng, "other")[1]))
    _feed(intake, *encode(*_prefill(rng, "pinned")[1]))  # another prefix of a user held here
    _feed(intake, *encode(*_prefill(rng, "busy")[1]))
    report = intake.end()
    assert report.admitted == 0
    assert report.refusals == ["other: no_room", "pinned: held", "busy: computing"]
    held = store.peek(mine, Tier.HBM)
    assert held is not None and held.pinned


async def test_a_corrupt_or_foreign_entry_is_refused_and_its_user_misses_with_exact_scores(
    rng: np.random.Generator,
) -> None:
    foreign = RankingModel(tiny_config(), seed=8)
    assert foreign.model_version != MODEL.model_version
    p_bad, (key, kv) = _prefill(rng, "flipped")
    header, payload = encode(key, kv)
    flipped = bytearray(payload)
    flipped[int(rng.integers(0, len(payload)))] ^= 1 << int(rng.integers(0, 8))
    p_foreign, foreign_entry = _prefill(rng, "foreign", foreign)
    f_header, f_payload = encode(*foreign_entry)
    with running_engine(hbm_prefixes=8) as (engine, _):
        stats = HandoffStats()
        intake = HandoffIntake(engine.core, MODEL.cfg, MODEL.model_version, MODEL.device, stats)
        _feed(intake, header, bytes(flipped))
        _feed(intake, f_header, f_payload)
        # Truncated: the stream breaks mid-entry.
        intake.header(header)
        intake.data(payload[:100])
        intake.abandon()
        assert intake.report.refusals == [
            "flipped: corrupt",
            "foreign: wrong_version",
            "flipped: corrupt",
        ]
        assert stats.refused[Refusal.CORRUPT] == 2 and stats.refused[Refusal.WRONG_VERSION] == 1
        assert engine.store.usage(Tier.HBM).entries == 0
        for p in (p_bad, p_foreign):
            request = rank_input(rng, p)
            result = await engine.rank(request, None)
            assert result.outcome is CacheOutcome.MISS
            assert rel_err(result.scores, MODEL.full_forward(request)) <= 1e-5
