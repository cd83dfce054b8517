"""The ranker's checks of domain inputs against its model config (ranges and limits)."""

from relaygr.behaviours import Behaviours, Int64Array, Prefix, RankInput
from relaygr.errors import InvalidInput
from services.ranker.model_config import ModelConfig


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
