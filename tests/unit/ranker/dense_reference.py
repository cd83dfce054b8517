"""A dense float64 reference of the ranking model's maths, written apart from the model's code.

It reads only the model's config, its weights (`state_dict`) and its LayerNorm epsilon, and
recomputes everything else with plain torch ops in float64: id hashing and bucketing, embedding
sums, the whole [T, T] attention mask and relative bias, pointwise SiLU attention normalised by
each row's key count, gating, FFN, norms and the task heads. Nothing from services.ranker's
embedding, bias, attention, layer or scoring code is called; the only things shared with the
model are the weight layout (parameter names, the u|v|q|k split order and head-major columns,
which a checkpoint fixes) and the input dataclasses.

The maths, for tokens t = [user features, long-term, short-term | candidates], T = N + C:

- position p: history token i sits at i; every candidate at N (right after the history).
- time s: user features at UNTIMED (the earliest instant), behaviours at their timestamp,
  candidates at request_ts.
- mask M[i, j]: a history row sees j <= i; a candidate row sees every history token and itself,
  never another candidate.
- bias rab(i, j) = w_pos[pos_bucket(p_i - p_j)] + w_time[time_bucket(s_i - s_j)].
- per layer: u, v, q, k = split(SiLU(Linear(LN(h)))); A = SiLU(q k^T / sqrt(d_qk) + rab) * M;
  out_i = sum_j A_ij v_j / sum_j M_ij; h += W_o(LN(out) * u) + b_o; h += FFN(h).
- scores = sigmoid(task_head(LN(h of candidates))), [tasks, C].

The time bucket is floor(2 * log2(max(gap, 1))) in exact integer arithmetic: the bit length
of gap^2 minus one (the model once evaluated it in float32, which put a few gaps just under a
half-octave boundary one bucket high; test_oracle.py pins those gaps).
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from relaygr.behaviours import Behaviours, RankInput
from services.ranker.model import RankingModel

# The input spec's constants, restated rather than imported so that a change to them shows up.
UNTIMED = -(1 << 62)  # user-profile tokens' timestamp: the earliest representable instant
CANDIDATE_ACTION = 0  # the action row every candidate adds to its item embedding
EXACT_POSITIONS = 16  # distances below this get a bucket each; beyond, four buckets per octave
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def hash_bucket(value: int, buckets: int, salt: int = 0) -> int:
    """SplitMix64's finaliser of (value + golden * (salt + 1)) mod 2^64, top 63 bits, mod buckets.

    Written with Python integers (arbitrary precision, masked to 64 bits), not numpy uint64.
    """
    x = ((value & _MASK64) + _GOLDEN * (salt + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 1) % buckets


def position_bucket(distance: int, buckets: int) -> int:
    """distance for distance < 16, else floor(4 * log2(distance)), capped at buckets - 1.

    floor(4 log2 d) = floor(log2 d^4) is computed exactly as the bit length of d^4 minus one
    (at d = 16 both rules give 16, so the buckets run on without a gap).
    """
    bucket = distance if distance < EXACT_POSITIONS else (distance**4).bit_length() - 1
    return min(bucket, buckets - 1)


def time_buckets(gaps: np.ndarray, buckets: int) -> np.ndarray:
    """floor(2 * log2(max(gap, 1))) = bit length of max(gap, 1)^2 minus one, in Python integers,
    capped at buckets - 1 (int64 array of the gaps' shape)."""
    exact = np.frompyfunc(lambda g: (max(int(g), 1) ** 2).bit_length() - 1, 1, 1)
    return np.minimum(exact(gaps).astype(np.int64), buckets - 1)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """(x - mean) / sqrt(biased variance + eps) * weight + bias over the last dimension."""
    mean = x.mean(-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + eps) * weight + bias


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


@dataclass(frozen=True, slots=True)
class ReferenceOutput:
    """What the reference computes for one request, in float64 on the CPU."""

    scores: torch.Tensor  # [tasks, candidates]
    # Per layer, [T, heads * d_v]: each row's attention output, divided by its key count, with
    # heads merged: the input of the layer's attention LayerNorm. Rows in token order.
    attention: list[torch.Tensor]
    n_history: int


class DenseReference:
    """Scores requests with the model's weights in float64, one dense [T, T] pass per request.

    Holds a float64 CPU copy of every weight, keyed by state_dict name. The copy is taken at
    construction: weights changed later are not seen.
    """

    def __init__(self, model: RankingModel) -> None:
        self.cfg = model.cfg
        self.w = {
            name: tensor.detach().to("cpu", torch.float64)
            for name, tensor in model.state_dict().items()
        }
        # LayerNorm's epsilon is a module attribute, not a weight; all of the model's agree.
        epsilons = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
        assert len(epsilons) == 1, epsilons
        self.eps = float(epsilons.pop())

    # -- inputs -------------------------------------------------------------------------------

    def _embed(self, request: RankInput) -> tuple[torch.Tensor, np.ndarray]:
        """Token embeddings [T, d_model] and timestamps [T] in the order of the module doc."""
        cfg, w = self.cfg, self.w
        rows: list[torch.Tensor] = []
        times: list[int] = []
        for slot, value in enumerate(request.prefix.user_features.tolist()):
            bucket = hash_bucket(value ^ (slot << 56), cfg.user_feature_buckets, salt=1)
            rows.append(
                w["embedding.user_values.weight"][bucket] + w["embedding.user_slots.weight"][slot]
            )
            times.append(UNTIMED)
        history: Behaviours = request.prefix.long_term.concat(request.short_term)
        for item, action, ts in zip(
            history.item_ids.tolist(),
            history.actions.tolist(),
            history.timestamps.tolist(),
            strict=True,
        ):
            bucket = hash_bucket(item, cfg.item_buckets)
            rows.append(w["embedding.items.weight"][bucket] + w["embedding.actions.weight"][action])
            times.append(ts)
        for item in request.candidates.tolist():
            bucket = hash_bucket(item, cfg.item_buckets)
            rows.append(
                w["embedding.items.weight"][bucket]
                + w["embedding.actions.weight"][CANDIDATE_ACTION]
            )
            times.append(request.request_ts)
        return torch.stack(rows), np.asarray(times, dtype=np.int64)

    def _mask_and_bias(
        self, n_history: int, times: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The [T, T] attention mask (float 0/1) and relative bias, built pair by pair."""
        total = len(times)
        index = torch.arange(total)
        is_candidate = index >= n_history
        causal = index[None, :] <= index[:, None]
        sees_history = ~is_candidate[None, :]  # key j is a history token
        itself = index[None, :] == index[:, None]
        mask = torch.where(is_candidate[:, None], sees_history | itself, causal)

        positions = torch.where(is_candidate, n_history, index)
        distances = (positions[:, None] - positions[None, :]).clamp(min=0)  # masked pairs: any
        table = torch.tensor(
            [position_bucket(d, self.cfg.num_position_buckets) for d in range(n_history + 1)]
        )
        position_bias = self.w["bias.position_weight"][table[distances]]
        gaps = times[:, None] - times[None, :]  # int64: UNTIMED is chosen so that this fits
        time_index = torch.from_numpy(time_buckets(gaps, self.cfg.num_time_buckets))
        time_bias = self.w["bias.time_weight"][time_index]
        return mask.to(torch.float64), position_bias + time_bias

    # -- the model ----------------------------------------------------------------------------

    def forward(self, request: RankInput) -> ReferenceOutput:
        """float64 scores of `request` and every layer's attention output."""
        cfg = self.cfg
        heads, d_qk, d_v = cfg.num_heads, cfg.d_qk, cfg.d_v
        h, times = self._embed(request)
        n_history, total = request.history_tokens, h.shape[0]
        mask, bias = self._mask_and_bias(n_history, times)
        counts = mask.sum(1)  # keys each row attends: the normaliser the model documents
        attention: list[torch.Tensor] = []
        for layer in range(cfg.num_layers):
            name = f"layers.{layer}"
            uvqk = silu(self._linear(self._norm(h, f"{name}.norm_in"), f"{name}.uvqk"))
            widths = [heads * d_v, heads * d_v, heads * d_qk, heads * d_qk]
            u, v, q, k = torch.split(uvqk, widths, dim=-1)
            # Columns are head-major within each part: [T, H * d] -> [T, H, d].
            q, k = q.reshape(total, heads, d_qk), k.reshape(total, heads, d_qk)
            v = v.reshape(total, heads, d_v)
            logits = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(d_qk) + bias
            weights = silu(logits) * mask  # pointwise: a masked pair contributes exactly 0
            out = torch.einsum("hij,jhd->ihd", weights, v) / counts[:, None, None]
            merged = out.reshape(total, heads * d_v)
            attention.append(merged)
            gated = self._norm(merged, f"{name}.norm_attention") * u
            h = h + self._linear(gated, f"{name}.project_out")
            if cfg.ffn_mult:
                hidden = silu(self._linear(self._norm(h, f"{name}.ffn.0"), f"{name}.ffn.1"))
                h = h + self._linear(hidden, f"{name}.ffn.3")
        final = self._norm(h[n_history:], "final_norm")
        scores = torch.sigmoid(self._linear(final, "task_head")).T
        return ReferenceOutput(scores, attention, n_history)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return layer_norm(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.eps)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.w[f"{name}.weight"].T + self.w[f"{name}.bias"]
