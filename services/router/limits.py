"""The router's input limits, checked on a request's packed bytes before it is forwarded.

The router never decodes the behaviour arrays (a full parse of an 8k-token request costs
~0.2 ms, the RoutingKey parse a few µs): it counts a packed array's values by counting the bytes
that end a varint, and only when the array's byte length alone cannot settle the question.
"""

from dataclasses import dataclass

import numpy as np

from relaygr.errors import InvalidInput
from relaygr.v1 import router_pb2

_CONTINUATION = 0x80  # a varint byte at or above this is followed by another of the same value


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Most history tokens (user features + long-term + short-term behaviours) and candidates."""

    max_tokens: int  # positive: RouterConfig validates both
    max_candidates: int


def packed_count(data: bytes) -> int:
    """The number of varints in a packed repeated field's bytes."""
    if not data:
        return 0
    return int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) < _CONTINUATION))


def _over(columns: tuple[bytes, ...], limit: int) -> int | None:
    """The number of values in `columns` when it exceeds `limit`, else None.

    Every value takes at least one byte, so columns of at most `limit` bytes need no count.
    """
    if sum(len(column) for column in columns) <= limit:
        return None
    count = sum(packed_count(column) for column in columns)
    return count if count > limit else None


def check_limits(key: router_pb2.RoutingKey, limits: RequestLimits) -> None:
    """Raise InvalidInput naming the limit a request (parsed as a RoutingKey) exceeds."""
    tokens = (key.user_features, key.long_term.item_ids, key.short_term.item_ids)
    if (count := _over(tokens, limits.max_tokens)) is not None:
        raise InvalidInput(
            f"request has {count} history tokens (user features + long-term + short-term"
            f" behaviours), over the router's limit of {limits.max_tokens}"
        )
    if (count := _over((key.candidate_ids,), limits.max_candidates)) is not None:
        raise InvalidInput(
            f"{count} candidates exceed the router's limit of {limits.max_candidates}"
        )
