"""How a missing device-resident prefix gets made, and what each step of that is predicted to cost.

Pure: the engine and the simulator both decide here, so they choose the same way."""

from dataclasses import dataclass
from enum import StrEnum

from relaygr.cost import CostModel
from services.ranker.chunks import chunk_ms, extension_spans, prefill_spans
from services.ranker.outcomes import CacheOutcome, PreInferOutcome

# A Rank computes its prefix itself only when that is predicted sooner than waiting by more than
# rounding: the two sums of the same costs differ in their last bits, and ties wait.
_SOONER = 1e-9


class Source(StrEnum):
    """How a missing device-resident prefix gets made."""

    RELOAD = "reload"
    EXTEND = "extend"
    PREFILL = "prefill"
    FETCH = "fetch"  # from a peer ranker that holds it (after a placement move)


# What a PreInfer and a Rank report when their prefix was made from each source.
PRE_INFER_OUTCOME = {
    Source.RELOAD: PreInferOutcome.RELOADED,
    Source.EXTEND: PreInferOutcome.EXTENDED,
    Source.PREFILL: PreInferOutcome.COMPUTED,
    Source.FETCH: PreInferOutcome.PEER_FETCHED,
}
RANK_OUTCOME = {
    Source.RELOAD: CacheOutcome.DRAM_HIT,
    Source.EXTEND: CacheOutcome.EXTENDED,
    Source.PREFILL: CacheOutcome.MISS,
    Source.FETCH: CacheOutcome.PEER_FETCHED,
}


@dataclass(frozen=True, slots=True)
class Held:
    """A cached prefix of the user's that a plan may start from."""

    num_behaviours: int
    num_tokens: int
    nbytes: int
    on_device: bool


@dataclass(frozen=True, slots=True)
class Costed:
    """The chosen source, the prefix tokens it computes (0 for a reload or a fetch) and each
    step's predicted milliseconds, in order."""

    source: Source
    computed_tokens: int
    step_ms: tuple[float, ...]


def cheapest(
    cost: CostModel,
    user_features: int,
    behaviours: int,
    host_copy: Held | None,
    base: Held | None,
    chunk: int | None,
    fetch_ms: float | None = None,
) -> Costed:
    """Reload `host_copy` (the prefix itself, in host memory) when that is cheaper than
    recomputing; else extend `base` (the user's newest cached strict prefix of it); else
    prefill. Computing runs in `chunk`-token steps (None: one call); extending a base that is
    not on the device first brings it over (one step). `fetch_ms`: the predicted time to fetch
    the prefix from a peer that may hold it (None: no peer to ask); the fetch is chosen only
    when it is predicted sooner than every local way, which is kept otherwise."""
    local = _local(cost, user_features, behaviours, host_copy, base, chunk)
    if fetch_ms is not None and fetch_ms < sum(local.step_ms):
        return Costed(Source.FETCH, 0, (fetch_ms,))
    return local


def _local(
    cost: CostModel,
    user_features: int,
    behaviours: int,
    host_copy: Held | None,
    base: Held | None,
    chunk: int | None,
) -> Costed:
    tokens = user_features + behaviours
    if host_copy is not None and cost.reload_is_cheaper(host_copy.nbytes, tokens):
        return Costed(Source.RELOAD, 0, (cost.reload_ms(host_copy.nbytes),))
    size = chunk if chunk is not None else max(tokens, 1)
    if base is not None:
        spans = extension_spans(user_features, base.num_behaviours, behaviours, size)
        bring = 0.0 if base.on_device else cost.reload_ms(base.nbytes)
        steps = (bring, *(chunk_ms(cost, span) for span in spans))
        return Costed(Source.EXTEND, tokens - base.num_tokens, steps)
    spans = prefill_spans(user_features, behaviours, size)
    return Costed(Source.PREFILL, tokens, tuple(chunk_ms(cost, span) for span in spans))


def sooner(plan_ms: float, remaining_ms: float) -> bool:
    """Is computing in `plan_ms` predicted to finish before waiting for `remaining_ms` of a
    queued job's steps? Ties wait."""
    return plan_ms < remaining_ms * (1 - _SOONER)
