"""A fetch's spans: `ranker.fetch` under the request that fetched, linked to the PreInfer that
produced the prefix on the peer; the Rank served from it links there too."""

from collections.abc import Iterator

import numpy as np
import pytest

from relaygr.cost import TransferCost
from services.ranker.engine import CacheOutcome, RankerEngine
from services.ranker.fetch import Fetched, FetchSettings, Peer, PeerFetch
from services.ranker.kv_store import CacheKey
from services.ranker.outcomes import FetchResult
from services.ranker.tracing_observer import origin_traceparent
from services.ranker.transfer import Receiver, encode
from tests.unit.ranker.factories import prefix, rank_input
from tests.unit.ranker.test_engine_tracing import MODEL, TOKENS, Traced, _engine, _ids

PEER = Peer("old-owner", "127.0.0.1:1")


class EnginePeer:
    """A peer that is another engine: what it holds, through the wire format and its checks."""

    def __init__(self, holder: RankerEngine) -> None:
        self.holder = holder

    def peers(self, key: CacheKey) -> list[Peer]:
        return [PEER]

    async def fetch(self, key: CacheKey, peer: Peer, timeout_s: float) -> Fetched | FetchResult:
        held = self.holder.held_for_peer(key)
        if held is None:
            return FetchResult.NOT_FOUND
        header, payload = encode(key, held[0], origin_traceparent(held[1]))
        receiver = Receiver(MODEL.cfg, MODEL.model_version, MODEL.device)
        assert receiver.start(header) is None and receiver.add(payload) is None
        kv = receiver.finish()
        assert not isinstance(kv, str)
        return Fetched(kv, header.origin_traceparent)


@pytest.fixture
def traced() -> Traced:
    return Traced()


@pytest.fixture
def pair(traced: Traced) -> Iterator[tuple[RankerEngine, RankerEngine]]:
    for holder in _engine(traced.tracer, hbm_entries=4):
        fetch = PeerFetch(
            EnginePeer(holder), FetchSettings(cap_s=1.0), TransferCost(0.0, 0.0), learn=False
        )
        for fetcher in _engine(traced.tracer, hbm_entries=4, peer_fetch=fetch):
            yield holder, fetcher


async def test_a_fetch_links_to_the_pre_infer_that_produced_it(
    traced: Traced, pair: tuple[RankerEngine, RankerEngine], rng: np.random.Generator
) -> None:
    holder, fetcher = pair
    request = rank_input(rng, prefix(rng, TOKENS, user_id="moved"))
    with traced.tracer.start_as_current_span("PreInfer on the old owner"):
        await holder.pre_infer(request.prefix, None, None)
    with traced.tracer.start_as_current_span("Rank on the new owner"):
        outcome = (await fetcher.rank(request, None)).outcome
    assert outcome is CacheOutcome.PEER_FETCHED
    pre_infer, rank = traced.one("PreInfer on the old owner"), traced.one("Rank on the new owner")
    fetch = traced.one("ranker.fetch")
    assert fetch.parent is not None and fetch.parent.span_id == _ids(rank)[1]
    assert fetch.attributes is not None
    assert fetch.attributes["relaygr.fetch.peer"] == PEER.instance_id
    assert fetch.attributes["relaygr.fetch.result"] == "hit"
    assert fetch.attributes["relaygr.kv.bytes"] == (TOKENS + 4) * MODEL.cfg.cache_bytes_per_token
    [link] = fetch.links
    assert (link.context.trace_id, link.context.span_id) == _ids(pre_infer)
    [relay] = rank.links  # the Rank's relay link still points at the producing PreInfer
    assert (relay.context.trace_id, relay.context.span_id) == _ids(pre_infer)
    assert relay.attributes is not None and relay.attributes["relaygr.relay.producer"] == "peer"
