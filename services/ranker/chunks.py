"""Where a chunked prefill or extension splits, and each chunk's predicted compute time."""

import math

from relaygr.cost import CostModel

Span = tuple[int, int]  # (tokens cached before the step, tokens cached after it)


def prefill_spans(user_features: int, behaviours: int, chunk: int) -> list[Span]:
    """The steps of a prefill in `chunk`-token chunks: the first computes the user features and
    the behaviours that fill its chunk, each later one the next `chunk` behaviours."""
    steps = 1 + _extension_steps(_first_chunk(user_features, chunk), behaviours, chunk)
    return [prefill_span(user_features, behaviours, chunk, step) for step in range(steps)]


def extension_spans(user_features: int, start: int, behaviours: int, chunk: int) -> list[Span]:
    """The steps extending a prefix of `start` behaviours to `behaviours`, `chunk` at a time."""
    steps = _extension_steps(start, behaviours, chunk)
    return [extension_span(user_features, start, behaviours, chunk, step) for step in range(steps)]


def prefill_span(user_features: int, behaviours: int, chunk: int, step: int) -> Span:
    """Step `step` of `prefill_spans`, without listing the others (a scheduler asks for one
    step at a time); IndexError past the last."""
    first = _first_chunk(user_features, chunk)
    if step == 0:
        return (0, user_features + min(first, behaviours))
    return extension_span(user_features, first, behaviours, chunk, step - 1)


def extension_span(user_features: int, start: int, behaviours: int, chunk: int, step: int) -> Span:
    """Step `step` of `extension_spans`; IndexError past the last."""
    begin = start + step * chunk
    if step < 0 or begin >= behaviours:
        raise IndexError(f"no step {step} extending {start} to {behaviours} behaviours")
    return (user_features + begin, user_features + min(begin + chunk, behaviours))


def _first_chunk(user_features: int, chunk: int) -> int:
    """Behaviours in a prefill's first chunk, beside the user features."""
    return max(chunk - user_features, 0)


def _extension_steps(start: int, behaviours: int, chunk: int) -> int:
    return max(0, -(-(behaviours - start) // chunk))


def chunk_ms(cost: CostModel, span: Span) -> float:
    """One model call computing the tokens of `span` on top of those cached before it: a fixed
    cost per call, its tokens, and their pairs with each other and with the cached ones (over
    one span from 0 this is `cost.prefill_ms`; chunking adds only the extra calls' fixed cost)."""
    cached, after = span
    new = after - cached
    return (
        cost.fixed_ms + cost.per_token_ms * new + cost.per_pair_ms * (new * cached + new * new / 2)
    )


def background_chunk(cost: CostModel, least: int, fixed_share: float, most: int) -> int:
    """The tokens of a background prefill chunk under `cost`: the fewest, in multiples of
    `least`, whose call spends at most `fixed_share` of its predicted time on the call's fixed
    cost; never below `least`, nor past `most` (unless `least` is). A Rank arriving meanwhile
    waits for at most one chunk, so a chunk is small; but each chunk is one call, and where a
    call's fixed cost is large beside a token's (an accelerator: 1 ms against 1e-3 ms a token)
    small chunks make a relayed prefill cost several times its compute. The token term alone
    decides (the pair term only adds to a chunk's time, so the share holds with it)."""
    if fixed_share >= 1.0 or cost.fixed_ms <= 0.0 or most <= least:
        return least
    if cost.per_token_ms <= 0.0:
        return most
    tokens = cost.fixed_ms * (1.0 - fixed_share) / (fixed_share * cost.per_token_ms)
    return min(least * max(1, math.ceil(tokens / least)), most)
