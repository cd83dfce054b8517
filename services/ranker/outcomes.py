"""What a PreInfer or a Rank found in the prefix cache, what a peer fetch came to, the jobs the
ranker runs and who produced a prefix: the ranker core's vocabulary (no torch, no I/O)."""

from enum import StrEnum
from typing import NewType


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


# Who produced or last relayed a prefix cache, as the observer that made it sees it: opaque to the
# engine and the KV store, which only carry it from the producing request to the consuming Rank
# (and compare two for equality: the same producer gives equal origins).
Origin = NewType("Origin", object)


class Operation(StrEnum):
    """The request that produces a prefix: the `operation` of its origin."""

    PRE_INFER = "pre_infer"
    RANK = "rank"
    PEER = "peer"  # a request on a peer ranker, the prefix fetched from it (which one: unknown)


class Work(StrEnum):
    """A job the engine runs on the compute scheduler."""

    PREFILL = "prefill"
    EXTEND = "extend"
    RELOAD = "reload"  # a host (DRAM) copy brought back to the device
    RANK = "rank"  # scoring against a device-resident prefix
    FULL_FORWARD = "full_forward"  # a bypass Rank: full inference, nothing cached
