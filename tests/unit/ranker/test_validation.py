"""Bad input raises a typed error that names the problem."""

import numpy as np
import pytest

from relaygr.behaviours import Behaviours, Prefix, RankInput
from relaygr.errors import InvalidInput
from relaygr.v1 import common_pb2
from relaygr.wire import rank_input_from_proto, rank_request_to_proto
from services.ranker.model import RankingModel

from .factories import behaviours, prefix, rank_input, tiny_config

CFG = tiny_config(max_history_tokens=200, max_candidates=10, max_user_features=3)


@pytest.fixture(scope="module")
def model() -> RankingModel:
    return RankingModel(CFG, seed=1)


def test_ragged_columns_are_named() -> None:
    with pytest.raises(InvalidInput, match=r"ragged.*item_ids has 3.*actions 2.*timestamps 3"):
        Behaviours.of([1, 2, 3], [1, 1], [5, 6, 7])


def test_non_integer_columns_are_named() -> None:
    with pytest.raises(InvalidInput, match=r"short_term\.timestamps must be integers"):
        Behaviours.of([1], [1], ["soon"], what="short_term")


def test_the_first_timestamp_before_its_predecessor_is_named() -> None:
    times = [3, 5, 9, 9, 5, 2, 1]  # entries 4, 5 and 6 go back: the first is named
    with pytest.raises(InvalidInput) as err:
        Behaviours.of([1] * 7, [1] * 7, times, what="long_term")
    assert str(err.value) == (
        "long_term.timestamps[4] = 5 is before timestamps[3] = 9;"
        " behaviour timestamps must be non-decreasing"
    )
    with pytest.raises(InvalidInput, match=r"^short_term\.timestamps\[1\] = -1 is before"):
        Behaviours.of([1, 1], [1, 1], [0, -1], what="short_term")


@pytest.mark.parametrize("times", [[], [7], [7, 7, 7], [1, 2, 2, 3]])
def test_non_decreasing_timestamps_are_accepted(times: list[int]) -> None:
    n = len(times)
    assert Behaviours.of([1] * n, [1] * n, times).timestamps.tolist() == times


def test_reversed_timestamps_are_refused_where_requests_become_domain_inputs(
    rng: np.random.Generator,
) -> None:
    """Ranker and trigger build their inputs with `relaygr.wire`: both sequences are checked."""
    good = rank_request_to_proto(rank_input(rng, prefix(rng, 8)))
    rank_input_from_proto(good)
    for what in ("long_term", "short_term"):
        bad = common_pb2.RankRequest()
        bad.CopyFrom(good)
        column = getattr(bad, what).timestamps
        column[2] = column[1] - 1
        with pytest.raises(InvalidInput, match=rf"^{what}\.timestamps\[2\] = "):
            rank_input_from_proto(bad)


def _bad_requests(rng: np.random.Generator) -> dict[str, tuple[RankInput, str]]:
    good = rank_input(rng, prefix(rng, 20, n_user=2), n_short=5, n_candidates=4)
    p = good.prefix

    def with_prefix(**changes: object) -> RankInput:
        fields = {"user_id": p.user_id, "user_features": p.user_features, "long_term": p.long_term}
        fields.update(changes)
        return RankInput(Prefix(**fields), good.short_term, good.candidates, good.request_ts)  # type: ignore[arg-type]

    bad_action = behaviours(rng, 5)
    bad_action.actions[2] = CFG.num_actions
    reserved = behaviours(rng, 5)
    reserved.actions[0] = 0
    negative_ts = behaviours(rng, 5)
    negative_ts.timestamps[1] = -5
    return {
        "empty user": (with_prefix(user_id=""), "user_id must not be empty"),
        "user features": (
            with_prefix(user_features=np.arange(4)),
            "4 user features exceed the limit of 3",
        ),
        "long tokens": (with_prefix(long_term=behaviours(rng, 199)), "201 tokens.*limit of 200"),
        "total tokens": (
            RankInput(p, behaviours(rng, 180), good.candidates, good.request_ts),
            "202 history tokens.*limit of 200",
        ),
        "no candidates": (
            RankInput(p, good.short_term, np.zeros(0, np.int64), good.request_ts),
            "at least one candidate",
        ),
        "many candidates": (
            RankInput(p, good.short_term, np.arange(11), good.request_ts),
            "11 candidates exceed the limit of 10",
        ),
        "action range": (with_prefix(long_term=bad_action), f"action {CFG.num_actions} is outside"),
        "reserved action": (
            RankInput(p, reserved, good.candidates, good.request_ts),
            "short_term action 0 is outside.*reserved for candidates",
        ),
        "negative ts": (with_prefix(long_term=negative_ts), "long_term timestamps must be >= 0"),
        "negative request ts": (
            RankInput(p, good.short_term, good.candidates, -1),
            "request_ts must be >= 0",
        ),
    }


def test_each_bad_request_is_refused_by_every_entry_point(
    model: RankingModel, rng: np.random.Generator
) -> None:
    cases = _bad_requests(rng)
    for name, (request, message) in cases.items():
        with pytest.raises(InvalidInput, match=message):
            model.full_forward(request)
        prefix_problem = name in {
            "empty user",
            "user features",
            "long tokens",
            "action range",
            "negative ts",
        }
        if prefix_problem:
            with pytest.raises(InvalidInput, match=message):
                model.prefill(request.prefix)
        else:
            kv = model.prefill(request.prefix)
            with pytest.raises(InvalidInput, match=message):
                model.rank(kv, request.short_term, request.candidates, request.request_ts)


def test_extend_past_the_token_limit_is_refused(
    model: RankingModel, rng: np.random.Generator
) -> None:
    kv = model.prefill(prefix(rng, 150, n_user=2))
    with pytest.raises(InvalidInput, match="extended prefix would have 202 tokens"):
        model.extend(kv, behaviours(rng, 50))


def test_a_cache_from_another_model_is_refused(rng: np.random.Generator) -> None:
    a, b = RankingModel(CFG, seed=1), RankingModel(CFG, seed=2)
    request = rank_input(rng, prefix(rng, 10, n_user=2), n_short=2, n_candidates=3)
    kv = a.prefill(request.prefix)
    with pytest.raises(InvalidInput, match=f"built by model {a.model_version}"):
        b.rank(kv, request.short_term, request.candidates, request.request_ts)
    with pytest.raises(InvalidInput, match="built by model"):
        b.extend(kv, behaviours(rng, 3))


def _at_limits(rng: np.random.Generator, over: int) -> dict[str, tuple[RankInput, str]]:
    """Requests exactly at each of CFG's limits (`over` 0), or `over` past it, and the message
    naming the limit that one past it gets."""
    limit = CFG.max_history_tokens
    features = CFG.max_user_features
    few = rank_input(rng, prefix(rng, 20, n_user=2), n_short=5, n_candidates=4)
    p = few.prefix

    def request(n_user: int, n_long: int, n_short: int, n_candidates: int) -> RankInput:
        return rank_input(rng, prefix(rng, n_long, n_user=n_user), n_short, n_candidates)

    return {
        "candidates": (
            RankInput(p, few.short_term, np.arange(CFG.max_candidates + over), few.request_ts),
            f"{CFG.max_candidates + over} candidates exceed the limit of {CFG.max_candidates}",
        ),
        "user features": (
            request(features + over, 10, 2, 3),
            f"{features + over} user features exceed the limit of {features}",
        ),
        "prefix tokens": (
            request(features, limit - features + over, 0, 3),
            f"prefix has {limit + over} tokens .* limit of {limit}",
        ),
        "history tokens": (
            request(features, 150, limit - features - 150 + over, 3),
            f"request has {limit + over} history tokens .* limit of {limit}",
        ),
    }


@pytest.mark.parametrize("what", ["candidates", "user features", "prefix tokens", "history tokens"])
def test_each_limit_admits_exactly_its_value_and_refuses_one_more(
    model: RankingModel, rng: np.random.Generator, what: str
) -> None:
    """Limits are inclusive (CFG's, not the default 64 candidates): at the limit every entry
    point scores the request; one past it each refuses it naming the limit."""
    request, _ = _at_limits(rng, 0)[what]
    full = model.full_forward(request)
    cached = model.rank(
        model.prefill(request.prefix), request.short_term, request.candidates, request.request_ts
    )
    assert cached.shape == full.shape == (2, len(request.candidates))
    over, message = _at_limits(rng, 1)[what]
    with pytest.raises(InvalidInput, match=message):
        model.full_forward(over)
    with pytest.raises(InvalidInput, match=message):
        kv = model.prefill(over.prefix)
        model.rank(kv, over.short_term, over.candidates, over.request_ts)


def test_extend_to_exactly_the_token_limit_is_accepted(
    model: RankingModel, rng: np.random.Generator
) -> None:
    kv = model.prefill(prefix(rng, 150, n_user=2))
    more = CFG.max_history_tokens - kv.num_tokens
    assert model.extend(kv, behaviours(rng, more)).num_tokens == CFG.max_history_tokens
    with pytest.raises(InvalidInput, match="extended prefix would have 201 tokens"):
        model.extend(kv, behaviours(rng, more + 1))
