"""What a PreInfer or a Rank found in the prefix cache: the engine's outcomes."""

from enum import StrEnum


class PreInferOutcome(StrEnum):
    COMPUTED = "computed"
    ALREADY_RESIDENT = "already_resident"
    JOINED_INFLIGHT = "joined_inflight"
    EXTENDED = "extended"
    RELOADED = "reloaded"


class CacheOutcome(StrEnum):
    HBM_HIT = "hbm_hit"
    DRAM_HIT = "dram_hit"
    WAITED_INFLIGHT = "waited_inflight"
    EXTENDED = "extended"
    MISS = "miss"
    BYPASS = "bypass"
