"""Where a chunked prefill or extension splits, and each chunk's predicted compute time."""

from relaygr.cost import CostModel

Span = tuple[int, int]  # (tokens cached before the step, tokens cached after it)


def prefill_spans(user_features: int, behaviours: int, chunk: int) -> list[Span]:
    """The steps of a prefill in `chunk`-token chunks: the first computes the user features and
    the behaviours that fill its chunk, each later one the next `chunk` behaviours."""
    first = max(chunk - user_features, 0)
    head = (0, user_features + min(first, behaviours))
    return [head, *extension_spans(user_features, first, behaviours, chunk)]


def extension_spans(user_features: int, start: int, behaviours: int, chunk: int) -> list[Span]:
    """The steps extending a prefix of `start` behaviours to `behaviours`, `chunk` at a time."""
    return [
        (user_features + begin, user_features + min(begin + chunk, behaviours))
        for begin in range(start, behaviours, chunk)
    ]


def chunk_ms(cost: CostModel, span: Span) -> float:
    """One model call computing the tokens of `span` on top of those cached before it: a fixed
    cost per call, its tokens, and their pairs with each other and with the cached ones (over
    one span from 0 this is `cost.prefill_ms`; chunking adds only the extra calls' fixed cost)."""
    cached, after = span
    new = after - cached
    return (
        cost.fixed_ms + cost.per_token_ms * new + cost.per_pair_ms * (new * cached + new * new / 2)
    )
