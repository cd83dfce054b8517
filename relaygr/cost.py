"""A ranker's calibrated latency model: the ranker's reload policy and the trigger both use it.

Free of torch, so the trigger and router import it without loading the model stack.
"""

from collections.abc import Sequence
from dataclasses import dataclass

# The cached-rank terms' names (CostModel, ranker.proto CostModel, the membership record).
CACHED_TERMS = (
    "cached_fixed_ms", "cached_per_row_ms", "cached_per_key_ms", "cached_per_row_key_ms",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class CostModel:
    """Milliseconds for `t` history tokens and `c` candidates (see ranker.proto CostModel).

    full = fixed + per_token * (t + c) + per_pair * t^2 / 2 + per_candidate_key * c * t
    prefill = fixed + per_token * t + per_pair * t^2 / 2

    `median_abs_rel_error` and `samples` say how far to trust it: the median of
    |predicted - measured| / measured over the `samples` timed runs it was fitted to (0 and 0:
    not fitted here, e.g. given by configuration or a test).

    Scoring on a cached prefix (`rank_ms` with cached tokens and candidates) has terms of its
    own, fitted to timed Ranks: a call that puts r = n + c rows (n short-term tokens, c
    candidates) through the layers against k = p + n keys (p cached tokens) costs

    cached rank = cached_fixed + cached_per_row * r + cached_per_key * k
                  + cached_per_row_key * r * k

    A full inference's few-query tail on a long prefix runs at another efficiency than the
    prefill's large matrix products (and reads the whole cache), so the full-inference terms
    price it badly (measured: 2-8x high on CPU). All four 0: not fitted, and the full-inference
    terms price it (an assumed profile, an older ranker).

    Batches (`batch_ms`): `batch_saving_ms` is what each request after the first saves when B
    requests run as one model call instead of B calls (per-call work a batch pays once: kernel
    launches, Python dispatch, GEMM set-up); `batch_samples` how many timed batches it was
    fitted to. 0 and 0: not known, a batch costs its requests' single calls.
    """

    fixed_ms: float
    per_token_ms: float
    per_pair_ms: float
    per_candidate_key_ms: float
    reload_ms_per_mb: float
    median_abs_rel_error: float = 0.0
    samples: int = 0
    batch_saving_ms: float = 0.0
    batch_samples: int = 0
    cached_fixed_ms: float = 0.0
    cached_per_row_ms: float = 0.0
    cached_per_key_ms: float = 0.0
    cached_per_row_key_ms: float = 0.0

    def full_ms(self, tokens: int, candidates: int) -> float:
        return (
            self.fixed_ms
            + self.per_token_ms * (tokens + candidates)
            + self.per_pair_ms * tokens * tokens / 2
            + self.per_candidate_key_ms * candidates * tokens
        )

    def prefill_ms(self, tokens: int) -> float:
        return self.fixed_ms + self.per_token_ms * tokens + self.per_pair_ms * tokens * tokens / 2

    @property
    def prices_cached_ranks(self) -> bool:
        """Are the cached-rank terms fitted (any of them non-zero)?"""
        return (
            self.cached_fixed_ms
            + self.cached_per_row_ms
            + self.cached_per_key_ms
            + self.cached_per_row_key_ms
        ) > 0

    def cached_terms(self) -> dict[str, float]:
        """The cached-rank terms by name (`CACHED_TERMS`), as the wire and profiles carry them."""
        return {term: getattr(self, term) for term in CACHED_TERMS}

    def rank_ms(self, cached_tokens: int, new_tokens: int, candidates: int) -> float:
        """One call on a cached prefix of `cached_tokens`: computing `new_tokens` (the short-term
        behaviours) on top of it and scoring `candidates` against all of them.

        With candidates on a cached prefix, the cached-rank terms when fitted. Otherwise the
        full-inference terms: with no cached tokens this is `full_ms(new_tokens, candidates)`
        (or `prefill_ms`), and a prefill of t tokens followed by this call costs
        `full_ms(t + new_tokens, candidates)` plus one more call's fixed cost."""
        tokens = cached_tokens + new_tokens
        if cached_tokens > 0 and candidates > 0 and self.prices_cached_ranks:
            rows = new_tokens + candidates
            return (
                self.cached_fixed_ms
                + self.cached_per_row_ms * rows
                + self.cached_per_key_ms * tokens
                + self.cached_per_row_key_ms * rows * tokens
            )
        return (
            self.fixed_ms
            + self.per_token_ms * (new_tokens + candidates)
            + self.per_pair_ms * (new_tokens * cached_tokens + new_tokens * new_tokens / 2)
            + self.per_candidate_key_ms * candidates * tokens
        )

    def reload_ms(self, nbytes: int) -> float:
        return self.reload_ms_per_mb * nbytes / 2**20

    def shape_ms(self, shape: "CallShape") -> float:
        """One request's time alone: `rank_ms` of its shape (a miss or a first chunk: 0 cached
        tokens, and then `full_ms` or `prefill_ms`)."""
        return self.rank_ms(shape.cached_tokens, shape.new_tokens, shape.candidates)

    def reload_is_cheaper(self, nbytes: int, tokens: int) -> bool:
        """Bring a host copy back rather than recompute the prefix?"""
        return self.reload_ms(nbytes) < self.prefill_ms(tokens)


@dataclass(frozen=True, slots=True)
class TransferCost:
    """Milliseconds to fetch a cached prefix of `nbytes` from a peer ranker (see ranker.proto
    CostModel.transfer_*): fixed + ms_per_mb * MiB, request to a checked, device-resident entry.

    `median_abs_rel_error` and `samples` as in `CostModel` (0 and 0: the configured prior).
    """

    fixed_ms: float
    ms_per_mb: float
    median_abs_rel_error: float = 0.0
    samples: int = 0

    def ms(self, nbytes: int) -> float:
        return self.fixed_ms + self.ms_per_mb * nbytes / 2**20


@dataclass(frozen=True, slots=True)
class CallShape:
    """One request's share of a model call: `new_tokens` history tokens computed on top of
    `cached_tokens` already cached, then `candidates` scored against all of them.

    A cached Rank: (prefix, short-term, candidates); a miss's full inference: (0, history,
    candidates); a background prefill chunk: (done so far, chunk, 0).
    """

    cached_tokens: int
    new_tokens: int
    candidates: int


def batch_ms(cost: CostModel, shapes: Sequence[CallShape]) -> float:
    """Predicted milliseconds of one model call over the requests `shapes` (RankingModel's
    rank_batch, full_forward_batch or chunk_batch).

    Each request's single-call time, less `batch_saving_ms` for every request after the
    first, and never less than its slowest request alone (a batch does all its requests'
    work). One request: `shape_ms`; an empty batch: 0.
    """
    if not shapes:
        return 0.0
    alone = [cost.shape_ms(s) for s in shapes]
    return max(sum(alone) - cost.batch_saving_ms * (len(alone) - 1), max(alone))


def batch_speedup(cost: CostModel, shape: CallShape, size: int) -> float:
    """Batch efficiency: the throughput of `size` requests of `shape` as one call over that of
    `size` single calls (1 for one request, or when the saving is not known)."""
    return size * cost.shape_ms(shape) / batch_ms(cost, [shape] * size)
