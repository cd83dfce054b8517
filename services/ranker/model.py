"""The HSTU ranking model and its four entry points: full_forward, prefill, extend, rank."""

import hashlib
import json
from collections.abc import Sequence
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


@dataclass(frozen=True, slots=True)
class RankItem:
    """One user's Rank in a batch: its cached prefix, short-term behaviours, candidates and
    request time (the arguments of `RankingModel.rank`)."""

    kv: PrefixKV
    short_term: Behaviours
    candidates: Int64Array
    request_ts: int


@dataclass(frozen=True, slots=True)
class Extension:
    """One user's prefill chunk on top of its cached prefix (the arguments of `extend`)."""

    kv: PrefixKV
    more_long_term: Behaviours


@dataclass(frozen=True, slots=True)
class _Run:
    """New history tokens `x` [n, d] of one user after its cached `past`; `ts` holds the
    timestamps of past and new tokens."""

    past: PrefixKV | None
    x: torch.Tensor
    ts: torch.Tensor

    @property
    def n_past(self) -> int:
        return self.past.num_tokens if self.past else 0

    @property
    def n_new(self) -> int:
        return int(self.x.shape[0])


@dataclass(frozen=True, slots=True)
class _Scored:
    """One user's candidates to score against its cached `past` and its `new` history."""

    past: PrefixKV | None
    new: _Keys
    ts: torch.Tensor
    candidates: Int64Array
    request_ts: int

    @property
    def n_past(self) -> int:
        return self.past.num_tokens if self.past else 0


def _rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of every part, in order (a lone part as it is: no copy for a batch of one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
    # Entry points: each single-request one is its batch of one

    @torch.inference_mode()
    def full_forward(self, request: RankInput) -> torch.Tensor:
        """Scores [tasks, candidates] by full inference over the whole request (no cache)."""
        return self.full_forward_batch([request])[0]

    @torch.inference_mode()
    def prefill(self, prefix: Prefix) -> PrefixKV:
        """Compute the K/V of every prefix token [U, S_l] at every layer."""
        return self.chunk_batch([prefix])[0]

    @torch.inference_mode()
    def extend(self, kv: PrefixKV, more_long_term: Behaviours) -> PrefixKV:
        """The prefix `kv` followed by `more_long_term`; equal to prefilling the whole prefix."""
        return self.chunk_batch([Extension(kv, more_long_term)])[0]

    @torch.inference_mode()
    def rank(
        self, kv: PrefixKV, short_term: Behaviours, candidates: Int64Array, request_ts: int
    ) -> torch.Tensor:
        """Scores [tasks, candidates] for the prefix cached in `kv` plus short-term behaviours."""
        return self.rank_batch([RankItem(kv, short_term, candidates, request_ts)])[0]

    @torch.inference_mode()
    def full_forward_batch(self, requests: Sequence[RankInput]) -> list[torch.Tensor]:
        """`full_forward` of each request, in one pass: scores [tasks, candidates] in order."""
        kept = self.full_forward_keeping(requests, [False] * len(requests))
        return [scores for scores, _ in kept]

    @torch.inference_mode()
    def full_forward_keeping(
        self, requests: Sequence[RankInput], keep: Sequence[bool]
    ) -> list[tuple[torch.Tensor, PrefixKV | None]]:
        """Full inference of each request in one pass, and, where `keep` says, its prefix's
        K/V: scores [tasks, candidates] and the PrefixKV a `prefill` of the request's prefix
        gives (its tokens come first in the history and attend to nothing after them), or
        None. A miss computed this way is one call, not a prefill and then a rank."""
        if len(keep) != len(requests):
            raise ValueError("one keep flag per request")
        for request in requests:
            validate_rank_input(request, self.cfg)
        histories = [
            _Run(
                None,
                *self._embed_history(
                    r.prefix.user_features, r.prefix.long_term.concat(r.short_term)
                ),
            )
            for r in requests
        ]
        new = self._history(histories)
        scores = self._score(
            [
                _Scored(None, keys, run.ts, r.candidates, r.request_ts)
                for r, run, keys in zip(requests, histories, new, strict=True)
            ]
        )
        return [
            (s, self._kept_prefix(r.prefix, run, keys) if k else None)
            for r, run, keys, s, k in zip(requests, histories, new, scores, keep, strict=True)
        ]

    @torch.inference_mode()
    def rank_batch(self, items: Sequence[RankItem]) -> list[torch.Tensor]:
        """`rank` of each item (its own cached prefix, short-term behaviours, candidates and
        request time), in one pass: scores [tasks, candidates] per item, in item order."""
        runs = []
        for item in items:
            self._check_cache(item.kv)
            validate_suffix(
                item.short_term, item.candidates, item.request_ts, item.kv.num_tokens, self.cfg
            )
            ts = torch.cat([item.kv.timestamps, self._tensor(item.short_term.timestamps)])
            runs.append(_Run(item.kv, self.embedding.behaviours(item.short_term), ts))
        new = self._history(runs)
        return self._score(
            [
                _Scored(item.kv, keys, run.ts, item.candidates, item.request_ts)
                for item, run, keys in zip(items, runs, new, strict=True)
            ]
        )

    @torch.inference_mode()
    def chunk_batch(self, items: Sequence[Prefix | Extension]) -> list[PrefixKV]:
        """Several users' prefill chunks in one pass: a `Prefix` is prefilled from nothing, an
        `Extension` extends its cached prefix. Returns each item's new PrefixKV, in order."""
        runs = [self._chunk_run(item) for item in items]
        new = self._history(runs)
        out = []
        for item, run, keys in zip(items, runs, new, strict=True):
            stored_keys = self._stack_for_storage(keys.keys)
            stored_values = self._stack_for_storage(keys.values)
            if isinstance(item, Extension):
                out.append(
                    PrefixKV(
                        keys=torch.cat([item.kv.keys, stored_keys], dim=2),
                        values=torch.cat([item.kv.values, stored_values], dim=2),
                        timestamps=run.ts,
                        num_user_tokens=item.kv.num_user_tokens,
                        hasher=item.kv.hasher.absorb(item.more_long_term),
                        model_version=self.model_version,
                    )
                )
            else:
                out.append(
                    PrefixKV(
                        keys=stored_keys,
                        values=stored_values,
                        timestamps=run.ts,
                        num_user_tokens=len(item.user_features),
                        hasher=PrefixHasher.start(item.user_features).absorb(item.long_term),
                        model_version=self.model_version,
                    )
                )
        return out

    def _chunk_run(self, item: Prefix | Extension) -> "_Run":
        if isinstance(item, Prefix):
            validate_prefix(item, self.cfg)
            return _Run(None, *self._embed_history(item.user_features, item.long_term))
        kv, more = item.kv, item.more_long_term
        self._check_cache(kv)
        validate_behaviours(more, self.cfg, "long_term")
        total = kv.num_tokens + len(more)
        if total > self.cfg.max_history_tokens:
            raise InvalidInput(
                f"extended prefix would have {total} tokens, over the limit of "
                f"{self.cfg.max_history_tokens}"
            )
        ts = torch.cat([kv.timestamps, self._tensor(more.timestamps)])
        return _Run(kv, self.embedding.behaviours(more), ts)

    # ----------------------------------------------------------------------------------------
    # The one pass every entry point shares, over a batch of users

    def _history(self, runs: Sequence["_Run"]) -> list[_Keys]:
        """K/V at every layer of each run's new history tokens, which follow its cached past.

        Runs advance in lockstep by query block: block j of every run that has one passes
        through every layer before block j + 1 starts (block-outer order keeps the bias of a
        block computed once for all layers, and is exactly chunked prefill). The projections
        and feed-forward layers take the rows of all runs at once; attention is per run,
        against its own past and its own new tokens only (jagged blocks: nothing padded).
        """
        cfg = self.cfg
        block, last = cfg.attention_block, len(self.layers) - 1
        out: list[_Keys] = []
        for run in runs:
            width = (cfg.num_heads, run.n_new)
            out.append(
                _Keys(
                    [run.x.new_empty(*width, cfg.d_qk) for _ in self.layers],
                    [run.x.new_empty(*width, cfg.d_v) for _ in self.layers],
                )
            )
        pasts = [self._compute_view(run.past) for run in runs]
        tables = [self.bias.position_table(run.n_past + run.n_new, pad=block) for run in runs]
        for start in range(0, max((run.n_new for run in runs), default=0), block):
            active = [i for i, run in enumerate(runs) if run.n_new > start]
            spans, biases, counts, rows = [], [], [], []
            offset = 0
            for i in active:
                run = runs[i]
                stop = min(start + block, run.n_new)
                first = run.n_past + start
                biases.append(
                    self.bias.block(
                        tables[i], block, first, run.ts[first : run.n_past + stop],
                        run.ts[: run.n_past + stop],
                    )
                )  # fmt: skip
                rows.append(run.x[start:stop])
                counts.append(key_counts(first, run.n_past + stop, run.x))
                spans.append((offset, offset + stop - start, stop))
                offset += stop - start
            h = _rows(rows)
            count = _rows(counts)
            for index, layer in enumerate(self._hstu_layers()):
                u, v, q, k = layer.project(h)
                for i, (lo, hi, stop) in zip(active, spans, strict=True):
                    out[i].keys[index][:, start:stop] = k[:, lo:hi]
                    out[i].values[index][:, start:stop] = v[:, lo:hi]
                if index == last:
                    break  # the last layer's outputs of history tokens feed nothing
                attention = torch.zeros_like(v)
                for i, bias, (lo, hi, stop) in zip(active, biases, spans, strict=True):
                    n_past, mine, query = runs[i].n_past, attention[:, lo:hi], q[:, lo:hi]
                    if n_past:
                        past = pasts[i]
                        attend(mine, query, past.keys[index], past.values[index], bias[:, :n_past])
                    attend(
                        mine,
                        query,
                        out[i].keys[index][:, :stop],
                        out[i].values[index][:, :stop],
                        bias[:, n_past:],
                        causal_from=start,
                    )
                h = layer.finish(h, u, attention.div_(count[:, None]))
        return out

    def _score(self, items: Sequence["_Scored"]) -> list[torch.Tensor]:
        """Candidates attend to every history token of their own user and to themselves;
        [tasks, C] scores per item. Rows of all items share the projections and feed-forward
        layers; attention to a history is per item."""
        if not items:
            return []
        rows, counts, spans, biases, pasts = [], [], [], [], []
        offset = 0
        for item in items:
            n_history = item.n_past + item.new.length
            table = self.bias.position_table(n_history, pad=0)
            ts = item.ts
            biases.append(
                self.bias.block(table, 0, n_history, ts.new_full((1,), item.request_ts), ts)[0]
            )
            embedded = self.embedding.candidates(item.candidates)
            rows.append(embedded)
            # Every candidate sits at position n_history: the history and itself.
            counts.append(key_counts(n_history, n_history + 1, embedded).expand(len(embedded)))
            spans.append((offset, offset + len(embedded)))
            offset += len(embedded)
            pasts.append(self._compute_view(item.past))
        self_bias = self.bias.position_weight[0] + self.bias.time_weight[0]
        h = _rows(rows)
        count = _rows(counts)
        for index, layer in enumerate(self._hstu_layers()):
            u, v, q, k = layer.project(h)
            attention = attend_self(q, k, v, self_bias)
            for item, past, row, (lo, hi) in zip(items, pasts, biases, spans, strict=True):
                n_past, mine, query = item.n_past, attention[:, lo:hi], q[:, lo:hi]
                if n_past:
                    attend(mine, query, past.keys[index], past.values[index], row[:n_past])
                if item.new.length:
                    attend(mine, query, item.new.keys[index], item.new.values[index], row[n_past:])
            h = layer.finish(h, u, attention.div_(count[:, None]))
        scores = torch.sigmoid(self.task_head(self.final_norm(h)))
        return [scores[lo:hi].T.contiguous() for lo, hi in spans]

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

    def _kept_prefix(self, prefix: Prefix, run: "_Run", keys: _Keys) -> PrefixKV:
        """The K/V of `prefix`'s tokens, the first of the history `run` computed to `keys`."""
        n = prefix.num_tokens
        return PrefixKV(
            keys=self._stack_for_storage([k[:, :n] for k in keys.keys]),
            values=self._stack_for_storage([v[:, :n] for v in keys.values]),
            timestamps=run.ts[:n].clone(),
            num_user_tokens=len(prefix.user_features),
            hasher=PrefixHasher.start(prefix.user_features).absorb(prefix.long_term),
            model_version=self.model_version,
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
