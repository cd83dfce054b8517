"""Peer fetch in the engine, with a fake peer: a moved user's prefix is fetched when the transfer
is predicted sooner than recomputing (and computed when not), once however many requests ask,
and every failed fetch (not found, stalled, broken, corrupt) falls back to computing; every
score equals full inference."""

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest

from relaygr.behaviours import Prefix
from relaygr.cost import CostModel, TransferCost
from services.ranker.digest import PrefixHasher
from services.ranker.engine import (
    CacheOutcome,
    EngineSettings,
    PreInferOutcome,
    RankerEngine,
    RankResult,
)
from services.ranker.fetch import Fetched, FetchSettings, Peer, PeerFetch
from services.ranker.kv_store import CacheKey, KVStore, Tier
from services.ranker.observer import Origin, Work
from services.ranker.outcomes import FetchResult
from services.ranker.plan import Costed, Held, Source, cheapest
from services.ranker.queues import Priority
from services.ranker.transfer import Receiver, encode
from services.ranker.transfer_cost import TransferLearner, TransferSample, fit_transfer_cost
from tests.unit.ranker.factories import prefix, rank_input
from tests.unit.ranker.test_engine import (
    CANDIDATES,
    CHEAP_RELOAD,
    KV_BYTES,
    MODEL,
    SHORT,
    TOKENS,
    USER_FEATURES,
    Clock,
    Counting,
    Gate,
    assert_full_inference,
)
from tests.unit.ranker.test_engine_extension import assert_dense_exact

CHEAP_TRANSFER = TransferCost(fixed_ms=0.1, ms_per_mb=0.0)  # far below a prefill's ~2 ms
DEAR_TRANSFER = TransferCost(fixed_ms=1e3, ms_per_mb=0.0)
PEER = Peer("old-owner", "127.0.0.1:1")
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def produced(p: Prefix) -> tuple[CacheKey, Fetched]:
    """`p`'s prefix as a peer computed it and this ranker received it: through the wire format
    and its checks, so it carries a sealed hasher, like every fetched prefix."""
    kv = MODEL.prefill(p)
    digest = PrefixHasher.start(p.user_features).absorb(p.long_term).digest()
    key = CacheKey(p.user_id, MODEL.model_version, digest)  # type: ignore[arg-type]
    header, payload = encode(key, kv, TRACEPARENT)
    receiver = Receiver(MODEL.cfg, MODEL.model_version, MODEL.device)
    assert receiver.start(header) is None and receiver.add(payload) is None
    received = receiver.finish()
    assert not isinstance(received, str)
    return key, Fetched(received, TRACEPARENT)


@dataclass
class FakePeers:
    """A peer that holds `held`, answering as `mode` says; `release` (when set) holds every
    fetch until it is set."""

    held: dict[CacheKey, Fetched] = field(default_factory=dict)
    mode: str = "serve"  # serve, not_found, stall, raise, corrupt, impostor
    peers_of: list[Peer] = field(default_factory=lambda: [PEER])
    calls: list[CacheKey] = field(default_factory=list)
    release: asyncio.Event | None = None

    def peers(self, key: CacheKey) -> list[Peer]:
        return self.peers_of

    async def fetch(self, key: CacheKey, peer: Peer, timeout_s: float) -> Fetched | FetchResult:
        self.calls.append(key)
        if self.release is not None:
            await self.release.wait()
        if self.mode == "stall":
            await asyncio.Event().wait()  # never answers: the fetch's own timeout ends it
        if self.mode == "raise":
            raise ConnectionResetError("peer went away mid-fetch")
        if self.mode in ("corrupt", "impostor"):  # a well-formed entry of another prefix
            other = next(iter(self.held.values()))
            return Fetched(other.kv.to("cpu"), "")
        got = self.held.get(key)
        return FetchResult.NOT_FOUND if got is None or self.mode == "not_found" else got


@dataclass
class Observed(Counting):
    fetches: list[tuple[str, FetchResult, int]] = field(default_factory=list)
    producers: list[Origin | None] = field(default_factory=list)

    def remote_origin(self, traceparent: str) -> Origin | None:
        return Origin(traceparent) if traceparent else None

    def fetched(
        self,
        peer: str,
        result: FetchResult,
        nbytes: int,
        seconds: float,
        start_ns: int,
        producer: Origin | None,
    ) -> None:
        self.fetches.append((peer, result, nbytes))
        self.producers.append(producer)


@contextmanager
def fetching_engine(
    peers: FakePeers,
    transfer: TransferCost = CHEAP_TRANSFER,
    cost: CostModel = CHEAP_RELOAD,
    hbm_prefixes: float = 4.0,
) -> Iterator[tuple[RankerEngine, Observed]]:
    clock = Clock()
    store = KVStore(
        int(hbm_prefixes * KV_BYTES), 8 * KV_BYTES, dram_ttl=600.0, clock=clock,
        to_host=lambda kv: kv.to("cpu"),
    )  # fmt: skip
    settings = EngineSettings(True, relay_window_s=30.0, prefill_chunk_tokens=64)
    observer = Observed()
    fetch = PeerFetch(peers, FetchSettings(cap_s=0.05), transfer, learn=False)
    engine = RankerEngine(MODEL, store, cost, settings, observer, fetch, clock=clock)
    try:
        yield engine, observer
    finally:
        engine.stop()


# -- the decision (pure) --------------------------------------------------------------------


def test_cheapest_fetches_only_when_sooner_than_every_local_way() -> None:
    prefill = cheapest(CHEAP_RELOAD, USER_FEATURES, TOKENS, None, None, None)
    assert prefill.source is Source.PREFILL
    assert cheapest(CHEAP_RELOAD, USER_FEATURES, TOKENS, None, None, None, None) == prefill
    total = sum(prefill.step_ms)
    assert cheapest(CHEAP_RELOAD, USER_FEATURES, TOKENS, None, None, None, total / 2) == Costed(
        Source.FETCH, 0, (total / 2,)
    )
    assert cheapest(CHEAP_RELOAD, USER_FEATURES, TOKENS, None, None, None, total) == prefill
    # A host copy reloads in far less than a fetch: the reload stays.
    host = Held(TOKENS, TOKENS + USER_FEATURES, KV_BYTES, on_device=False)
    reload = cheapest(CHEAP_RELOAD, USER_FEATURES, TOKENS, host, None, None, total / 2)
    assert reload.source is Source.RELOAD
    # A cached base that leaves 4 behaviours to compute: extending beats the fetch.
    base = Held(TOKENS - 4, TOKENS - 4 + USER_FEATURES, KV_BYTES, on_device=True)
    extend = cheapest(CHEAP_RELOAD, USER_FEATURES, TOKENS, None, base, None, 0.9 * total)
    assert extend.source is Source.EXTEND and sum(extend.step_ms) < 0.9 * total
    # Chunked (background) work pays each chunk's fixed cost: the fetch is weighed against it.
    chunked = cheapest(CHEAP_RELOAD, USER_FEATURES, TOKENS, None, None, 16)
    assert sum(chunked.step_ms) > total
    between = (total + sum(chunked.step_ms)) / 2
    assert cheapest(CHEAP_RELOAD, USER_FEATURES, TOKENS, None, None, 16, between).source is (
        Source.FETCH
    )


def test_a_fetch_waits_twice_its_predicted_time_within_cap_and_deadline() -> None:
    settings = FetchSettings(cap_s=0.25, floor_s=0.02)
    assert settings.timeout_s(10.0, None) == pytest.approx(0.04)
    assert settings.timeout_s(1e3, None) == 0.25
    assert settings.timeout_s(10.0, 0.01) == 0.01
    assert settings.timeout_s(10.0, -1.0) == 0.0


# -- the engine ------------------------------------------------------------------------------


def test_a_moved_users_rank_is_served_from_the_fetched_prefix(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="moved"))
    key, entry = produced(request.prefix)
    peers = FakePeers({key: entry})
    with fetching_engine(peers) as (engine, observer):

        async def scenario() -> tuple[RankResult, RankResult]:
            first = await engine.rank(request, None)
            return first, await engine.rank(rank_input(rng, request.prefix), None)

        ranked, again = asyncio.run(scenario())
        assert (ranked.outcome, ranked.computed_tokens, ranked.relayed) == (
            CacheOutcome.PEER_FETCHED,
            SHORT + CANDIDATES,
            False,
        )
        assert again.outcome is CacheOutcome.HBM_HIT  # it landed, unpinned, like a computed one
        assert observer.landed == []  # nothing computed
        assert observer.fetches == [(PEER.instance_id, FetchResult.HIT, KV_BYTES)]
        assert observer.producers == [TRACEPARENT]  # the fetch links to the producing request
        held = engine.store.peek(key, Tier.HBM)
        assert held is not None and not held.pinned and held.origin == TRACEPARENT
        assert engine.peer_fetch is not None
        assert engine.peer_fetch.stats.attempts == {FetchResult.HIT: 1}
        assert engine.peer_fetch.stats.bytes_fetched == KV_BYTES
    assert_full_inference(ranked, request)


def test_a_pre_infer_fetches_and_pins_for_its_rank(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="moved"))
    key, entry = produced(request.prefix)
    with fetching_engine(FakePeers({key: entry})) as (engine, observer):

        async def scenario() -> RankResult:
            pre = await engine.pre_infer(request.prefix, None, None)
            assert pre.outcome is PreInferOutcome.PEER_FETCHED
            held = engine.store.peek(key, Tier.HBM)
            assert held is not None and held.pinned
            return await engine.rank(request, None)

        ranked = asyncio.run(scenario())
        assert (ranked.outcome, ranked.relayed) == (CacheOutcome.HBM_HIT, True)
        assert observer.landed == []
    assert_full_inference(ranked, request)


def test_a_fetch_dearer_than_recomputing_is_not_made(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="moved"))
    key, entry = produced(request.prefix)
    peers = FakePeers({key: entry})
    with fetching_engine(peers, transfer=DEAR_TRANSFER) as (engine, observer):
        ranked = asyncio.run(engine.rank(request, None))
        assert ranked.outcome is CacheOutcome.MISS
        assert peers.calls == [] and observer.fetches == []
        # Computed here instead, as its full inference (which keeps the prefix).
        assert (observer.landed, observer.scored) == ([], [Work.FULL_FORWARD])
    assert_full_inference(ranked, request)


def test_a_host_copy_is_reloaded_not_fetched(rng: np.random.Generator) -> None:
    a = rank_input(rng, prefix(rng, TOKENS, user_id="a"))
    key, entry = produced(a.prefix)
    peers = FakePeers({key: entry})
    with fetching_engine(peers, hbm_prefixes=1.5, transfer=DEAR_TRANSFER) as (engine, _observer):

        async def scenario() -> RankResult:
            await engine.rank(a, None)  # computed (a fetch is dearer), then pushed to DRAM
            await engine.pre_infer(prefix(rng, TOKENS, user_id="b"), None, None)
            assert engine.store.tier_of(key) is Tier.DRAM
            assert engine.peer_fetch is not None
            engine.peer_fetch._prior = CHEAP_TRANSFER  # now cheap: the host copy still wins
            return await engine.rank(a, None)

        ranked = asyncio.run(scenario())
        assert ranked.outcome is CacheOutcome.DRAM_HIT
        assert peers.calls == []
    assert_full_inference(ranked, a)


@pytest.mark.parametrize(
    ("mode", "result"),
    [
        ("not_found", FetchResult.NOT_FOUND),
        ("stall", FetchResult.TIMEOUT),
        ("raise", FetchResult.ERROR),
        ("corrupt", FetchResult.REFUSED),
        ("impostor", FetchResult.REFUSED),  # another prefix of the very same size
    ],
)
def test_a_failed_fetch_computes_the_prefix_exactly(
    rng: np.random.Generator, mode: str, result: FetchResult
) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="moved"))
    # What a corrupt peer sends instead: another size, or (an impostor) the same size, which
    # only the digest tells apart.
    other = prefix(rng, TOKENS + (0 if mode == "impostor" else 8), user_id="other")
    other_key, other_entry = produced(other)
    peers = FakePeers({other_key: other_entry}, mode=mode, peers_of=[PEER, Peer("p2", "x:2")])
    with fetching_engine(peers) as (engine, observer):
        ranked = asyncio.run(engine.rank(request, None))
        assert ranked.outcome is CacheOutcome.MISS
        assert ranked.computed_tokens == TOKENS + USER_FEATURES + SHORT + CANDIDATES
        assert observer.landed == [(Work.PREFILL, TOKENS + USER_FEATURES)]
        assert [f[1] for f in observer.fetches] == [result, result]  # both peers asked
        assert engine.inflight() == 0
        usage = engine.store.usage(Tier.HBM)
        assert usage.used_bytes <= usage.budget_bytes
    assert_full_inference(ranked, request)


@pytest.mark.parametrize("whose", ["another-user", "same-user-another-history"])
def test_an_entry_of_another_prefix_of_the_same_size_is_refused(
    rng: np.random.Generator, whose: str
) -> None:
    """A peer answers with a well-formed entry of the very size and layout asked for, but of
    another prefix digest: only the digest tells it apart. The fetch is refused and the Rank
    computes its own prefix, scored as the dense reference scores it."""
    request = rank_input(rng, prefix(rng, TOKENS, user_id="moved"))
    other = prefix(rng, TOKENS, user_id="other" if whose == "another-user" else "moved")
    other_key, other_entry = produced(other)
    assert other_entry.kv.nbytes == KV_BYTES
    assert other_entry.kv.num_user_tokens == USER_FEATURES
    peers = FakePeers({other_key: other_entry}, mode="corrupt", peers_of=[PEER, Peer("p2", "x:2")])
    with fetching_engine(peers) as (engine, observer):
        ranked = asyncio.run(engine.rank(request, None))
        assert_dense_exact(ranked, request)
        assert ranked.outcome is CacheOutcome.MISS
        assert observer.landed == [(Work.PREFILL, TOKENS + USER_FEATURES)]
        assert [f[1] for f in observer.fetches] == [FetchResult.REFUSED] * 2
        assert engine.store.tier_of(other_key) is None  # never landed under any key


def test_concurrent_ranks_share_one_fetch(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="moved"))
    key, entry = produced(request.prefix)
    with fetching_engine(FakePeers({key: entry})) as (engine, observer):
        peers = engine.peer_fetch.source  # type: ignore[union-attr]
        assert isinstance(peers, FakePeers)

        async def scenario() -> list[RankResult]:
            peers.release = asyncio.Event()
            ranks = [asyncio.create_task(engine.rank(request, None)) for _ in range(4)]
            while len(peers.calls) < 1 or engine.inflight() != 1:
                await asyncio.sleep(0)
            for _ in range(10):  # every Rank reaches the in-flight fetch
                await asyncio.sleep(0)
            peers.release.set()
            return list(await asyncio.gather(*ranks))

        results = asyncio.run(scenario())
        assert len(peers.calls) == 1
        outcomes = sorted(r.outcome for r in results)
        assert outcomes == sorted([CacheOutcome.PEER_FETCHED] + [CacheOutcome.WAITED_INFLIGHT] * 3)
        assert observer.landed == []
    for ranked in results:
        assert_full_inference(ranked, request)


def test_ranks_joining_a_failing_fetch_compute_once_at_rank_priority(
    rng: np.random.Generator,
) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="moved"))
    peers = FakePeers(mode="not_found")
    with fetching_engine(peers) as (engine, observer):

        async def scenario() -> list[object]:
            gate = Gate(engine)  # the fallback stays queued until the gate opens
            await gate.wait_entered()
            peers.release = asyncio.Event()
            pre = asyncio.create_task(engine.pre_infer(request.prefix, None, None))
            while not peers.calls:
                await asyncio.sleep(0)
            ranks = [asyncio.create_task(engine.rank(request, None)) for _ in range(3)]
            for _ in range(10):
                await asyncio.sleep(0)
            peers.release.set()
            while not engine.queues.depth(Priority.RANK):
                await asyncio.sleep(0)  # the fallback was lifted: a Rank waits on it
            gate.open()
            return [await pre, *await asyncio.gather(*ranks)]

        pre, *ranks = asyncio.run(scenario())
        assert len(peers.calls) == 1
        assert observer.landed == [(Work.PREFILL, TOKENS + USER_FEATURES)]
        assert pre.outcome is PreInferOutcome.COMPUTED  # type: ignore[attr-defined]
        assert {r.outcome for r in ranks} == {CacheOutcome.WAITED_INFLIGHT}  # type: ignore[attr-defined]
    for ranked in ranks:
        assert isinstance(ranked, RankResult)
        assert_full_inference(ranked, request)


def test_without_peers_nothing_is_fetched(rng: np.random.Generator) -> None:
    request = rank_input(rng, prefix(rng, TOKENS, user_id="owner"))
    peers = FakePeers(peers_of=[])
    with fetching_engine(peers) as (engine, _observer):
        ranked = asyncio.run(engine.rank(request, None))
        assert ranked.outcome is CacheOutcome.MISS and peers.calls == []
    assert_full_inference(ranked, request)


def test_a_peer_serves_the_exact_key_from_either_tier_without_moving_it(
    rng: np.random.Generator,
) -> None:
    a, b = prefix(rng, TOKENS, user_id="a"), prefix(rng, TOKENS, user_id="b")
    with fetching_engine(FakePeers(peers_of=[]), hbm_prefixes=1.5) as (engine, _):

        async def scenario() -> tuple[CacheKey, CacheKey]:
            pa = await engine.pre_infer(a, None, None)
            await engine.rank(rank_input(rng, a), None)
            pb = await engine.pre_infer(b, None, None)  # pinned; pushes a to DRAM
            return pa.key, pb.key

        ka, kb = asyncio.run(scenario())
        held_b = engine.held_for_peer(kb)
        held_a = engine.held_for_peer(ka)
        assert held_b is not None and held_a is not None
        assert held_a[0].device.type == "cpu" and engine.store.tier_of(ka) is Tier.DRAM
        entry = engine.store.peek(kb, Tier.HBM)
        assert entry is not None and entry.pinned  # still pinned for its own Rank
        stale = CacheKey(ka.user_id, ka.model_version, kb.digest)
        assert engine.held_for_peer(stale) is None


# -- the transfer cost -----------------------------------------------------------------------


def test_the_transfer_cost_fit_recovers_fixed_and_per_mib_despite_an_outlier() -> None:
    truth = TransferCost(fixed_ms=1.5, ms_per_mb=0.8)
    sizes = [2**20 * n for n in (1, 2, 4, 8, 16, 32)] * 2
    samples = [TransferSample(n, truth.ms(n)) for n in sizes]
    samples.append(TransferSample(2**20, 500.0))  # one fetch queued behind a burst
    fitted = fit_transfer_cost(samples)
    assert fitted.fixed_ms == pytest.approx(1.5, rel=1e-3)
    assert fitted.ms_per_mb == pytest.approx(0.8, rel=1e-3)
    assert fitted.samples == len(samples) and fitted.median_abs_rel_error < 1e-3


def test_the_learner_keeps_the_prior_until_it_has_enough_fetches() -> None:
    prior = TransferCost(2.0, 1.0)
    learner = TransferLearner(prior, refit_after=2, min_samples=4)
    for n in (1, 2, 4):
        assert learner.observe(TransferSample(n * 2**20, 0.5 + 0.25 * n)) == prior
    fitted = learner.observe(TransferSample(8 * 2**20, 2.5))
    assert fitted.fixed_ms == pytest.approx(0.5) and fitted.ms_per_mb == pytest.approx(0.25)
    assert learner.model == fitted


def test_a_hit_refits_the_transfer_cost_in_use(rng: np.random.Generator) -> None:
    requests = [rank_input(rng, prefix(rng, TOKENS, user_id=f"u{i}")) for i in range(8)]
    held = dict(produced(r.prefix) for r in requests)
    with fetching_engine(FakePeers(held), hbm_prefixes=9) as (engine, _):
        assert engine.peer_fetch is not None
        engine.peer_fetch._learner = TransferLearner(CHEAP_TRANSFER, refit_after=1, min_samples=2)

        async def scenario() -> list[RankResult]:
            return [await engine.rank(r, None) for r in requests]

        results = asyncio.run(scenario())
        assert engine.peer_fetch.transfer.samples >= 2  # measured fetches, no longer the prior
        assert results[0].outcome is CacheOutcome.PEER_FETCHED
    for ranked, request in zip(results, requests, strict=True):
        assert_full_inference(ranked, request)
