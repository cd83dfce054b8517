"""PrefixKV: per-layer K/V of a user's prefix, the baton the relay hands from PreInfer to Rank."""

from dataclasses import dataclass, replace

import torch

from services.ranker.digest import ModelVersion, PrefixDigest, PrefixHasher


@dataclass(frozen=True, slots=True)
class PrefixKV:
    """K and V of every prefix token at every layer, plus what ranking against them needs.

    `keys` is [layers, heads, tokens, d_qk] and `values` [layers, heads, tokens, d_v], stored in
    the configured KV dtype; `timestamps` (int64, [tokens]) feeds the relative time bias of later
    tokens. Token order is [user features..., long-term behaviours...].
    """

    keys: torch.Tensor
    values: torch.Tensor
    timestamps: torch.Tensor
    num_user_tokens: int
    hasher: PrefixHasher
    model_version: ModelVersion

    @property
    def digest(self) -> PrefixDigest:
        return self.hasher.digest()

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def num_behaviours(self) -> int:
        return self.num_tokens - self.num_user_tokens

    @property
    def nbytes(self) -> int:
        """Bytes held on its device: K, V and the token timestamps."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.timestamps))

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def to(self, device: torch.device | str, pin_memory: bool = False) -> "PrefixKV":
        """This prefix on `device`: itself when already there, else a copy.

        `pin_memory` page-locks a host copy so that reloading it to an accelerator is a fast,
        asynchronous DMA (the DRAM tier on CUDA and Ascend hosts).
        """
        target = torch.device(device)
        if self.keys.device == target:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            moved = t.to(target)
            return moved.pin_memory() if pin_memory and target.type == "cpu" else moved

        return replace(
            self, keys=move(self.keys), values=move(self.values), timestamps=move(self.timestamps)
        )
