"""The HSTU ranking model and its four entry points: full_forward, prefill, extend, rank."""

import hashlib
import json
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from relaygr.behaviours import Behaviours, Int64Array, Prefix, RankInput
from relaygr.device import select_device
from relaygr.errors import InvalidInput
from services.ranker.digest import PrefixHasher
from services.ranker.embedding import UNTIMED, TokenEmbedding
from services.ranker.hstu import HSTULayer, attend, attend_self, key_counts
from services.ranker.model_config import ModelConfig
from services.ranker.prefix_kv import ModelVersion, PrefixKV
from services.ranker.relative_bias import RelativeBias
from services.ranker.validation import (
    validate_behaviours,
    validate_prefix,
    validate_rank_input,
    validate_suffix,
)


@dataclass(frozen=True, slots=True)
class _Keys:
    """K/V of one run of history tokens at every layer, in float32 for compute."""

    keys: list[torch.Tensor]  # per layer [H, n, d_qk]
    values: list[torch.Tensor]  # per layer [H, n, d_v]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else 0


def content_version(cfg: ModelConfig, model: nn.Module) -> ModelVersion:
    """A digest of the config and every weight: equal models share it, any change alters it."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu", torch.float32).contiguous()
        digest.update(name.encode())
        digest.update(str(tuple(data.shape)).encode())
        digest.update(data.numpy().tobytes())
    return ModelVersion(f"hstu-{digest.hexdigest()}")


class RankingModel(nn.Module):
    """HSTU ranking model over [U, S_l, S_s | candidates] with exact prefix KV reuse.

    History attention is causal; each candidate attends to the whole history and to itself,
    never to another candidate, so its score does not depend on which candidates share the
    request. Rows are normalised by their own key count, so nothing a prefix token computes
    depends on what follows it: `rank(prefill(p), s, c)` equals `full_forward(p + s + c)` up to
    floating-point noise, and `extend` in any number of pieces equals one `prefill`.

    Every path is one pass over query blocks that skips masked work: keys after a block are
    never multiplied, candidate-by-candidate pairs never formed, and the last layer computes
    only the K/V of history tokens (their outputs feed nothing).
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = TokenEmbedding(cfg)
        self.bias = RelativeBias(cfg)
        self.layers = nn.ModuleList(HSTULayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model)
        self.task_head = nn.Linear(cfg.d_model, len(cfg.tasks))
        self._initialise(seed)
        self.eval()
        self.to(select_device(device) if isinstance(device, str) else device)
        self.model_version = content_version(cfg, self)

    def _initialise(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Embedding):
                    module.weight.normal_(0.0, 1.0, generator=generator)
                elif isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, module.in_features**-0.5, generator=generator)
                    module.bias.normal_(0.0, 0.02, generator=generator)
                elif isinstance(module, nn.LayerNorm):
                    module.weight.normal_(1.0, 0.1, generator=generator)
                    module.bias.normal_(0.0, 0.05, generator=generator)
            self.bias.position_weight.normal_(0.0, 0.5, generator=generator)
            self.bias.time_weight.normal_(0.0, 0.5, generator=generator)
            # Spread the task logits so that scores use the whole (0, 1) range.
            self.task_head.weight.mul_(2.0)

    def refresh_version(self) -> None:
        """Recompute model_version after the weights changed (checkpoint load)."""
        self.model_version = content_version(self.cfg, self)

    @property
    def device(self) -> torch.device:
        return self.bias.position_weight.device

    # ----------------------------------------------------------------------------------------
    # Entry points

    @torch.inference_mode()
    def full_forward(self, request: RankInput) -> torch.Tensor:
        """Scores [tasks, candidates] by full inference over the whole request (no cache)."""
        validate_rank_input(request, self.cfg)
        prefix = request.prefix
        x, ts = self._embed_history(
            prefix.user_features, prefix.long_term.concat(request.short_term)
        )
        new = self._history(None, x, ts)
        return self._score(None, new, ts, request.candidates, request.request_ts)

    @torch.inference_mode()
    def prefill(self, prefix: Prefix) -> PrefixKV:
        """Compute the K/V of every prefix token [U, S_l] at every layer."""
        validate_prefix(prefix, self.cfg)
        x, ts = self._embed_history(prefix.user_features, prefix.long_term)
        new = self._history(None, x, ts)
        return PrefixKV(
            keys=self._stack_for_storage(new.keys),
            values=self._stack_for_storage(new.values),
            timestamps=ts,
            num_user_tokens=len(prefix.user_features),
            hasher=PrefixHasher.start(prefix.user_features).absorb(prefix.long_term),
            model_version=self.model_version,
        )

    @torch.inference_mode()
    def extend(self, kv: PrefixKV, more_long_term: Behaviours) -> PrefixKV:
        """The prefix `kv` followed by `more_long_term`; equal to prefilling the whole prefix."""
        self._check_cache(kv)
        validate_behaviours(more_long_term, self.cfg, "long_term")
        total = kv.num_tokens + len(more_long_term)
        if total > self.cfg.max_history_tokens:
            raise InvalidInput(
                f"extended prefix would have {total} tokens, over the limit of "
                f"{self.cfg.max_history_tokens}"
            )
        x = self.embedding.behaviours(more_long_term)
        ts = torch.cat([kv.timestamps, self._tensor(more_long_term.timestamps)])
        new = self._history(kv, x, ts)
        return PrefixKV(
            keys=torch.cat([kv.keys, self._stack_for_storage(new.keys)], dim=2),
            values=torch.cat([kv.values, self._stack_for_storage(new.values)], dim=2),
            timestamps=ts,
            num_user_tokens=kv.num_user_tokens,
            hasher=kv.hasher.absorb(more_long_term),
            model_version=self.model_version,
        )

    @torch.inference_mode()
    def rank(
        self, kv: PrefixKV, short_term: Behaviours, candidates: Int64Array, request_ts: int
    ) -> torch.Tensor:
        """Scores [tasks, candidates] for the prefix cached in `kv` plus short-term behaviours."""
        self._check_cache(kv)
        validate_suffix(short_term, candidates, request_ts, kv.num_tokens, self.cfg)
        ts = torch.cat([kv.timestamps, self._tensor(short_term.timestamps)])
        new = self._history(kv, self.embedding.behaviours(short_term), ts)
        return self._score(kv, new, ts, candidates, request_ts)

    # ----------------------------------------------------------------------------------------
    # The one pass every entry point shares

    def _history(self, past: PrefixKV | None, x: torch.Tensor, ts: torch.Tensor) -> _Keys:
        """K/V at every layer of new history tokens `x` that follow the cached `past`.

        `ts` holds the timestamps of past and new tokens. New tokens run in query blocks; each
        block passes through every layer before the next starts (block-outer order keeps the
        bias of a block computed once for all layers, and is exactly chunked prefill).
        """
        cfg = self.cfg
        n_past, n_new = (past.num_tokens if past else 0), int(x.shape[0])
        width = (cfg.num_heads, n_new)
        keys = [x.new_empty(*width, cfg.d_qk) for _ in self.layers]
        values = [x.new_empty(*width, cfg.d_v) for _ in self.layers]
        past_keys = self._compute_view(past)
        block, last = cfg.attention_block, len(self.layers) - 1
        table = self.bias.position_table(n_past + n_new, pad=block)
        for start in range(0, n_new, block):
            stop = min(start + block, n_new)
            first = n_past + start
            bias = self.bias.block(
                table, block, first, ts[first : n_past + stop], ts[: n_past + stop]
            )
            counts = key_counts(first, n_past + stop, x)
            h = x[start:stop]
            for index, layer in enumerate(self._hstu_layers()):
                u, v, q, k = layer.project(h)
                keys[index][:, start:stop] = k
                values[index][:, start:stop] = v
                if index == last:
                    break  # the last layer's outputs of history tokens feed nothing
                out = torch.zeros_like(v)
                if n_past:
                    attend(out, q, past_keys.keys[index], past_keys.values[index], bias[:, :n_past])
                attend(
                    out,
                    q,
                    keys[index][:, :stop],
                    values[index][:, :stop],
                    bias[:, n_past:],
                    causal_from=start,
                )
                h = layer.finish(h, u, out.div_(counts[:, None]))
        return _Keys(keys, values)

    def _score(
        self,
        past: PrefixKV | None,
        new: _Keys,
        ts: torch.Tensor,
        candidates: Int64Array,
        request_ts: int,
    ) -> torch.Tensor:
        """Candidates attend to every history token and to themselves; [tasks, C] scores."""
        n_past = past.num_tokens if past else 0
        n_history = n_past + new.length
        past_keys = self._compute_view(past)
        table = self.bias.position_table(n_history, pad=0)
        row = self.bias.block(table, 0, n_history, ts.new_full((1,), request_ts), ts)[0]
        self_bias = self.bias.position_weight[0] + self.bias.time_weight[0]
        h = self.embedding.candidates(candidates)
        counts = key_counts(n_history, n_history + 1, h)  # the history and itself
        for index, layer in enumerate(self._hstu_layers()):
            u, v, q, k = layer.project(h)
            out = attend_self(q, k, v, self_bias)
            if n_past:
                attend(out, q, past_keys.keys[index], past_keys.values[index], row[:n_past])
            if new.length:
                attend(out, q, new.keys[index], new.values[index], row[n_past:])
            h = layer.finish(h, u, out.div_(counts[:, None]))
        return torch.sigmoid(self.task_head(self.final_norm(h))).T.contiguous()

    # ----------------------------------------------------------------------------------------
    # Helpers

    def _embed_history(
        self, user_features: Int64Array, behaviours: Behaviours
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.embedding.user(user_features), self.embedding.behaviours(behaviours)])
        untimed = np.full(len(user_features), UNTIMED, dtype=np.int64)
        ts = self._tensor(np.concatenate([untimed, behaviours.timestamps]))
        return x, ts

    def _hstu_layers(self) -> list[HSTULayer]:
        return cast(list[HSTULayer], list(self.layers))

    def _tensor(self, array: Int64Array) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _compute_view(self, past: PrefixKV | None) -> _Keys:
        if past is None:
            return _Keys([], [])
        return _Keys(
            [past.keys[i].float() for i in range(len(self.layers))],
            [past.values[i].float() for i in range(len(self.layers))],
        )

    def _stack_for_storage(self, per_layer: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(per_layer).to(self.cfg.kv_dtype.torch_dtype)

    def _check_cache(self, kv: PrefixKV) -> None:
        if kv.model_version != self.model_version:
            raise InvalidInput(
                f"prefix cache was built by model {kv.model_version}, this is {self.model_version}"
            )
        if kv.device != self.device:
            raise InvalidInput(f"prefix cache is on {kv.device}, the model on {self.device}")
