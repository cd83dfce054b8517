"""Relative position and time attention bias, shared by all layers and heads."""

import math

import torch
from torch import nn

from services.ranker.model_config import ModelConfig

_EXACT_POSITIONS = 16
_POSITION_BUCKETS_PER_OCTAVE = 4


def _log_boundaries(count: int, exact: int, per_octave: int) -> list[int]:
    """`count` strictly increasing integer bucket boundaries: 1..exact-1, then log-spaced."""
    bounds = list(range(1, exact))[:count]
    step = 0
    while len(bounds) < count:
        value = math.ceil(exact * 2 ** (step / per_octave))
        step += 1
        if not bounds or value > bounds[-1]:
            bounds.append(value)
    return bounds


class RelativeBias(nn.Module):
    """rab(i, j) = w_pos[bucket(p_i - p_j)] + w_time[bucket(t_i - t_j)].

    Distances are bucketed exactly up to 16 and log-spaced beyond; time gaps (seconds) fall in
    half-octave buckets, gaps under a second (negative ones too) in bucket 0. The bias depends
    only on the pair, never on how many tokens follow, which keeps prefix reuse exact.
    """

    position_bounds: torch.Tensor
    time_bounds: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.position_weight = nn.Parameter(torch.zeros(cfg.num_position_buckets))
        self.time_weight = nn.Parameter(torch.zeros(cfg.num_time_buckets))
        pos = _log_boundaries(
            cfg.num_position_buckets - 1, _EXACT_POSITIONS, _POSITION_BUCKETS_PER_OCTAVE
        )
        self.register_buffer(
            "position_bounds", torch.tensor(pos, dtype=torch.int64), persistent=False
        )
        # Bucket b = floor(2 log2 gap) = floor(log2 gap^2) starts at the least integer gap with
        # gap^2 >= 2^b: exact integer thresholds, so no float rounding moves a gap across one.
        times = [math.isqrt(2**b - 1) + 1 for b in range(1, cfg.num_time_buckets)]
        self.register_buffer(
            "time_bounds", torch.tensor(times, dtype=torch.int64), persistent=False
        )

    def position_table(self, max_distance: int, pad: int) -> torch.Tensor:
        """f(d - pad) for d in [0, max_distance + pad]: bias by distance, zero for negative ones."""
        distances = torch.arange(max_distance + 1, device=self.position_weight.device)
        buckets = torch.bucketize(distances, self.position_bounds, right=True)
        table = self.position_weight[buckets]
        return torch.cat([table.new_zeros(pad), table])

    def time(self, query_ts: torch.Tensor, key_ts: torch.Tensor) -> torch.Tensor:
        """[len(query_ts), len(key_ts)] time bias."""
        # floor(2 * log2(max(gap, 1))), capped, on the integer gaps: a float32 log2 rounded
        # gaps just under a half-octave boundary (e.g. 2^21 - 1) one bucket high.
        gaps = query_ts[:, None] - key_ts[None, :]
        return self.time_weight[torch.bucketize(gaps, self.time_bounds, right=True)]

    def block(
        self,
        table: torch.Tensor,
        pad: int,
        first_row: int,
        query_ts: torch.Tensor,
        key_ts: torch.Tensor,
    ) -> torch.Tensor:
        """Bias of queries at positions first_row.. over keys at positions 0..len(key_ts)-1.

        `table` comes from position_table(.., pad) with pad >= len(key_ts) - first_row - 1,
        so masked (future) pairs read zeros. The position part is a Toeplitz matrix, built as
        a strided view of the table instead of a gather.
        """
        rows, cols = len(query_ts), len(key_ts)
        offset = first_row - cols + 1 + pad
        toeplitz = table.as_strided((rows, cols), (1, 1), offset).flip(1)
        return toeplitz.add_(self.time(query_ts, key_ts))
