"""One HSTU layer and the pointwise (SiLU) attention it applies over key segments."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.ranker.model_config import ModelConfig


def attend(
    out: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    causal_from: int | None = None,
) -> None:
    """out += SiLU(query @ keys^T + bias) @ values, per head.

    query [H, M, dk], keys [H, N, dk], values [H, N, dv], bias broadcastable to [H, M, N],
    out [H, M, dv]. With `causal_from=c`, query row r may only see keys up to column c + r:
    the masked pairs are zeroed after the activation (pointwise attention has no softmax, so
    a zero weight is exactly "not attended"). Only the diagonal square is ever masked; callers
    never pass fully-masked key ranges.
    """
    scores = torch.bmm(query, keys.transpose(1, 2)).add_(bias)
    F.silu(scores, inplace=True)
    if causal_from is not None:
        rows = query.shape[1]
        diagonal = scores[:, :, causal_from : causal_from + rows]
        future = torch.ones(rows, rows, dtype=torch.bool, device=scores.device).triu_(1)
        diagonal.masked_fill_(future, 0.0)
    out.baddbmm_(scores, values)


def attend_self(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """value * SiLU(query . key + bias) per head and row: each row attending to itself alone.

    query/key [H, M, dk], value [H, M, dv]; bias is the distance-0 bias. This is the only
    diagonal of the candidate-by-candidate block that is ever formed: a candidate attends to
    itself, never to another candidate.
    """
    return value * F.silu((query * key).sum(-1, keepdim=True) + bias)


def key_counts(first_row: int, stop_row: int, like: torch.Tensor) -> torch.Tensor:
    """How many keys the query rows at positions first_row..stop_row-1 attend, as `like`'s dtype.

    The row at position i sees positions 0..i, itself included: i + 1 keys. A candidate sits at
    position n_history (it sees the whole history and itself), so it counts as that row. Rows
    are normalised by this count, never by the request length, so a prefix row's output does not
    depend on what follows it.
    """
    return torch.arange(first_row + 1, stop_row + 1, device=like.device, dtype=like.dtype)


class HSTULayer(nn.Module):
    """x -> x + W_o(LN(attention(x)) * U(x)) [-> + FFN].

    Projections are pointwise, so a token's output depends on earlier tokens only through
    attention; the caller supplies the keys and values those tokens produced.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.d_qk, self.d_v = cfg.num_heads, cfg.d_qk, cfg.d_v
        width_v, width_qk = cfg.num_heads * cfg.d_v, cfg.num_heads * cfg.d_qk
        self.norm_in = nn.LayerNorm(cfg.d_model)
        self.uvqk = nn.Linear(cfg.d_model, 2 * width_v + 2 * width_qk)
        self.norm_attention = nn.LayerNorm(width_v)
        self.project_out = nn.Linear(width_v, cfg.d_model)
        self.ffn: nn.Sequential | None = None
        if cfg.ffn_mult:
            hidden = cfg.ffn_mult * cfg.d_model
            self.ffn = nn.Sequential(
                nn.LayerNorm(cfg.d_model),
                nn.Linear(cfg.d_model, hidden),
                nn.SiLU(),
                nn.Linear(hidden, cfg.d_model),
            )
        self.scale = 1.0 / math.sqrt(cfg.d_qk)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """u [T, H*dv] and v [H, T, dv], q (pre-scaled) [H, T, dqk], k [H, T, dqk]."""
        width_v, width_qk = self.heads * self.d_v, self.heads * self.d_qk
        uvqk = F.silu(self.uvqk(self.norm_in(x)))
        u, v, q, k = torch.split(uvqk, [width_v, width_v, width_qk, width_qk], dim=-1)
        tokens = x.shape[0]

        def heads(t: torch.Tensor, dim: int) -> torch.Tensor:
            return t.reshape(tokens, self.heads, dim).transpose(0, 1).contiguous()

        return u, heads(v, self.d_v), heads(q * self.scale, self.d_qk), heads(k, self.d_qk)

    def finish(self, x: torch.Tensor, u: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Residual update from the attention output [H, T, dv] (already count-normalised)."""
        tokens = x.shape[0]
        merged = attention.transpose(0, 1).reshape(tokens, self.heads * self.d_v)
        x = x + self.project_out(self.norm_attention(merged) * u)
        if self.ffn is not None:
            x = x + self.ffn(x)
        return x
