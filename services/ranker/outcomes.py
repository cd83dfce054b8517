"""What a PreInfer or a Rank found in the prefix cache, and what a peer fetch came to: the
engine's outcomes."""

from enum import StrEnum


class PreInferOutcome(StrEnum):
    COMPUTED = "computed"
    ALREADY_RESIDENT = "already_resident"
    JOINED_INFLIGHT = "joined_inflight"
    EXTENDED = "extended"
    RELOADED = "reloaded"
    PEER_FETCHED = "peer_fetched"  # fetched from the peer ranker that held it


class CacheOutcome(StrEnum):
    HBM_HIT = "hbm_hit"
    DRAM_HIT = "dram_hit"
    WAITED_INFLIGHT = "waited_inflight"
    EXTENDED = "extended"
    MISS = "miss"
    BYPASS = "bypass"
    PEER_FETCHED = "peer_fetched"  # fetched from the peer ranker that held it


class FetchResult(StrEnum):
    """How one fetch of a prefix from one peer ranker ended."""

    HIT = "hit"  # a checked entry, now on this ranker's device
    NOT_FOUND = "not_found"  # the peer holds no entry with that exact key
    TIMEOUT = "timeout"  # no complete entry within the fetch's time
    REFUSED = "refused"  # an entry that failed a check on receipt (corrupt, wrong shape)
    ERROR = "error"  # the peer could not be reached or broke off (gone, overloaded)
