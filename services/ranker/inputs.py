"""Domain inputs of the ranking model (columnar behaviours, prefix, rank input) and their checks."""

from dataclasses import dataclass
from typing import NewType

import numpy as np
import numpy.typing as npt

from relaygr.errors import InvalidInput
from relaygr.ranker.model_config import ModelConfig

UserId = NewType("UserId", str)
Int64Array = npt.NDArray[np.int64]

_EMPTY = np.zeros(0, dtype=np.int64)


def as_int64(values: object, what: str) -> Int64Array:
    """Convert a sequence of integers to a 1-D int64 array, naming `what` on failure."""
    try:
        array = np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as err:
        raise InvalidInput(f"{what} must be integers: {err}") from err
    if array.ndim != 1:
        raise InvalidInput(f"{what} must be one-dimensional, got shape {array.shape}")
    return array


@dataclass(frozen=True, slots=True)
class Behaviours:
    """A behaviour sequence as parallel int64 columns; entry i of each column is behaviour i."""

    item_ids: Int64Array
    actions: Int64Array
    timestamps: Int64Array

    def __post_init__(self) -> None:
        lengths = (len(self.item_ids), len(self.actions), len(self.timestamps))
        if len(set(lengths)) != 1:
            items, actions, timestamps = lengths
            raise InvalidInput(
                f"ragged behaviour arrays: item_ids has {items} entries, actions {actions}, "
                f"timestamps {timestamps}"
            )

    @classmethod
    def of(
        cls, item_ids: object, actions: object, timestamps: object, what: str = ""
    ) -> "Behaviours":
        name = f"{what}." if what else ""
        return cls(
            as_int64(item_ids, f"{name}item_ids"),
            as_int64(actions, f"{name}actions"),
            as_int64(timestamps, f"{name}timestamps"),
        )

    @classmethod
    def empty(cls) -> "Behaviours":
        return cls(_EMPTY, _EMPTY, _EMPTY)

    def __len__(self) -> int:
        return len(self.item_ids)

    def slice(self, start: int, stop: int | None = None) -> "Behaviours":
        return Behaviours(
            self.item_ids[start:stop], self.actions[start:stop], self.timestamps[start:stop]
        )

    def concat(self, other: "Behaviours") -> "Behaviours":
        return Behaviours(
            np.concatenate([self.item_ids, other.item_ids]),
            np.concatenate([self.actions, other.actions]),
            np.concatenate([self.timestamps, other.timestamps]),
        )

    def records(self) -> Int64Array:
        """Row-major [n, 3] records (item, action, ts): the byte stream the prefix digest reads."""
        return np.stack([self.item_ids, self.actions, self.timestamps], axis=1)


@dataclass(frozen=True, slots=True)
class Prefix:
    """The candidate-independent part of a ranking input: [U, S_l]."""

    user_id: UserId
    user_features: Int64Array
    long_term: Behaviours

    @property
    def num_tokens(self) -> int:
        return len(self.user_features) + len(self.long_term)


@dataclass(frozen=True, slots=True)
class RankInput:
    """A full ranking input [U, S_l | S_s | I]; candidates are scored at `request_ts`."""

    prefix: Prefix
    short_term: Behaviours
    candidates: Int64Array
    request_ts: int

    @property
    def history_tokens(self) -> int:
        return self.prefix.num_tokens + len(self.short_term)


def validate_behaviours(behaviours: Behaviours, cfg: ModelConfig, what: str) -> None:
    """Raise InvalidInput when an action is outside the model's range or a timestamp negative."""
    if len(behaviours) == 0:
        return
    actions = behaviours.actions
    low, high = int(actions.min()), int(actions.max())
    if low < 1 or high >= cfg.num_actions:
        bad = low if low < 1 else high
        raise InvalidInput(
            f"{what} action {bad} is outside the valid range [1, {cfg.num_actions - 1}] "
            "(0 is reserved for candidates)"
        )
    if int(behaviours.timestamps.min()) < 0:
        raise InvalidInput(f"{what} timestamps must be >= 0 (Unix seconds)")


def validate_prefix(prefix: Prefix, cfg: ModelConfig) -> None:
    """Raise InvalidInput naming the first problem of `prefix` under `cfg`'s limits."""
    if not prefix.user_id:
        raise InvalidInput("user_id must not be empty")
    if len(prefix.user_features) > cfg.max_user_features:
        raise InvalidInput(
            f"{len(prefix.user_features)} user features exceed the limit of {cfg.max_user_features}"
        )
    validate_behaviours(prefix.long_term, cfg, "long_term")
    if prefix.num_tokens > cfg.max_history_tokens:
        raise InvalidInput(
            f"prefix has {prefix.num_tokens} tokens (user features + long-term behaviours), "
            f"over the limit of {cfg.max_history_tokens}"
        )


def validate_suffix(
    short_term: Behaviours,
    candidates: Int64Array,
    request_ts: int,
    prefix_tokens: int,
    cfg: ModelConfig,
) -> None:
    """Raise InvalidInput naming the first problem of what follows a prefix of `prefix_tokens`."""
    validate_behaviours(short_term, cfg, "short_term")
    history = prefix_tokens + len(short_term)
    if history > cfg.max_history_tokens:
        raise InvalidInput(
            f"request has {history} history tokens (user features + long-term + short-term), "
            f"over the limit of {cfg.max_history_tokens}"
        )
    count = len(candidates)
    if count == 0:
        raise InvalidInput("a rank request needs at least one candidate")
    if count > cfg.max_candidates:
        raise InvalidInput(f"{count} candidates exceed the limit of {cfg.max_candidates}")
    if request_ts < 0:
        raise InvalidInput("request_ts must be >= 0 (Unix seconds)")


def validate_rank_input(request: RankInput, cfg: ModelConfig) -> None:
    """Raise InvalidInput naming the first problem of `request` under `cfg`'s limits."""
    validate_prefix(request.prefix, cfg)
    validate_suffix(
        request.short_term, request.candidates, request.request_ts, request.prefix.num_tokens, cfg
    )
