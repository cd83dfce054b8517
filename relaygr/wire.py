"""Translation between relaygr.v1 messages and the shared domain inputs, both ways."""

from dataclasses import dataclass

import numpy as np

from relaygr.behaviours import Behaviours, Prefix, RankInput, UserId
from relaygr.errors import InvalidInput
from relaygr.v1 import common_pb2, trigger_pb2

MAX_ID_BYTES = 256

_Request = common_pb2.PreInferRequest | common_pb2.RankRequest | trigger_pb2.RetrievalEvent


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Most entries a request's arrays may hold, checked on the parsed message's lengths before
    any array is copied out of it (the engine then checks the model's full rules)."""

    max_user_features: int
    max_tokens: int  # history tokens: user features + long-term (+ short-term) behaviours
    max_candidates: int


def check_lengths(request: _Request, limits: InputLimits) -> None:
    """Raise InvalidInput naming the first array of `request` longer than `limits` allow."""
    features = len(request.user_features)
    if features > limits.max_user_features:
        raise InvalidInput(
            f"{features} user features exceed the limit of {limits.max_user_features}"
        )
    columns = [("long_term", request.long_term)]
    if isinstance(request, common_pb2.RankRequest):
        columns.append(("short_term", request.short_term))
        candidates = len(request.candidate_ids)
        if candidates > limits.max_candidates:
            raise InvalidInput(
                f"{candidates} candidates exceed the limit of {limits.max_candidates}"
            )
    tokens = features
    for what, behaviours in columns:
        tokens += max(len(behaviours.item_ids), len(behaviours.actions), len(behaviours.timestamps))
        if tokens > limits.max_tokens:
            raise InvalidInput(
                f"prefix has {tokens} tokens (user features + long-term behaviours), over the"
                f" limit of {limits.max_tokens}"
                if what == "long_term"
                else f"request has {tokens} history tokens (user features + long-term +"
                f" short-term), over the limit of {limits.max_tokens}"
            )


def behaviours_from_proto(msg: common_pb2.Behaviours, what: str) -> Behaviours:
    # np.array reads the packed containers through the buffer protocol: microseconds for 8k.
    return Behaviours.of(
        np.array(msg.item_ids, dtype=np.int64),
        np.array(msg.actions, dtype=np.int64),
        np.array(msg.timestamps, dtype=np.int64),
        what=what,
    )


def _check_ids(request_id: str, user_id: str) -> None:
    for name, value in (("request_id", request_id), ("user_id", user_id)):
        if len(value.encode()) > MAX_ID_BYTES:
            raise InvalidInput(f"{name} is longer than {MAX_ID_BYTES} bytes")


def prefix_from_proto(request: _Request, limits: InputLimits | None = None) -> Prefix:
    """The prefix of `request`; with `limits`, its arrays' lengths are checked first."""
    _check_ids(request.request_id, request.user_id)
    if limits is not None:
        check_lengths(request, limits)
    return Prefix(
        UserId(request.user_id),
        np.array(request.user_features, dtype=np.int64),
        behaviours_from_proto(request.long_term, "long_term"),
    )


def rank_input_from_proto(
    request: common_pb2.RankRequest, limits: InputLimits | None = None
) -> RankInput:
    return RankInput(
        prefix_from_proto(request, limits),
        behaviours_from_proto(request.short_term, "short_term"),
        np.array(request.candidate_ids, dtype=np.int64),
        request.request_ts,
    )


def behaviours_to_proto(behaviours: Behaviours) -> common_pb2.Behaviours:
    return common_pb2.Behaviours(
        item_ids=behaviours.item_ids.tolist(),
        actions=behaviours.actions.tolist(),
        timestamps=behaviours.timestamps.tolist(),
    )


def pre_infer_request_to_proto(
    prefix: Prefix, request_id: str = "", relay_window_ms: int = 0, request_ts: int = 0
) -> common_pb2.PreInferRequest:
    return common_pb2.PreInferRequest(
        request_id=request_id,
        user_id=prefix.user_id,
        user_features=prefix.user_features.tolist(),
        long_term=behaviours_to_proto(prefix.long_term),
        relay_window_ms=relay_window_ms,
        request_ts=request_ts,
    )


def rank_request_to_proto(request: RankInput, request_id: str = "") -> common_pb2.RankRequest:
    return common_pb2.RankRequest(
        request_id=request_id,
        user_id=request.prefix.user_id,
        user_features=request.prefix.user_features.tolist(),
        long_term=behaviours_to_proto(request.prefix.long_term),
        short_term=behaviours_to_proto(request.short_term),
        candidate_ids=request.candidates.tolist(),
        request_ts=request.request_ts,
    )
