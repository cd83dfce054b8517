"""relaygr.versions: the version policy, the choice of a request's version, a version's rankers;
and relaygr.live_value, which follows the policy at its etcd key."""

import logging
from collections import Counter

import numpy as np
import pytest

from relaygr.cluster import RankerRecord
from relaygr.errors import ConfigError
from relaygr.etcd.watch import EventKind, WatchEvent
from relaygr.live_value import live_policy
from relaygr.versions import (
    VersionIndexer,
    VersionPolicy,
    canary_point,
    choose_version,
    live_versions,
    serving,
    unavailable_message,
    versions_key,
)

LIVE = {"v1": 3, "v2": 1}


def ranker(instance_id: str, version: str) -> RankerRecord:
    return RankerRecord(
        instance_id, f"{instance_id}.rankers:50061", version, 1 << 30, 1 << 32, 1024,
        1.0, 0.001, 1e-7, 1e-6, 0.05,
    )  # fmt: skip


def canary_user(inside: bool, below: float = 0.5) -> str:
    """A user whose canary point is below `below` (inside) or not."""
    return next(
        u for u in (f"user-{i}" for i in range(1000)) if (canary_point(u) < below) == inside
    )


# -- the choice ------------------------------------------------------------------------------


def test_an_asked_version_wins_when_live_and_is_none_otherwise() -> None:
    policy = VersionPolicy(current="v1", canary="v2", canary_fraction=1.0)
    assert choose_version("u", "v1", policy, LIVE) == "v1"  # not the canary, though 100%
    assert choose_version("u", "v2", VersionPolicy(current="v1"), LIVE) == "v2"
    assert choose_version("u", "v3", policy, LIVE) is None
    assert choose_version("u", "v2", policy, {"v1": 3, "v2": 0}) is None


def test_a_canary_user_gets_the_canary_while_it_is_live() -> None:
    policy = VersionPolicy(current="v1", canary="v2", canary_fraction=0.5)
    inside, outside = canary_user(True), canary_user(False)
    assert choose_version(inside, "", policy, LIVE) == "v2"
    assert choose_version(outside, "", policy, LIVE) == "v1"
    assert choose_version(inside, "", policy, {"v1": 3}) == "v1"  # the canary is gone
    assert choose_version(inside, "", VersionPolicy(current="v1"), LIVE) == "v1"


def test_current_serves_everyone_else_and_the_majority_when_it_is_not_live() -> None:
    assert choose_version("u", "", VersionPolicy(current="v2"), LIVE) == "v2"  # minority
    assert choose_version("u", "", VersionPolicy(current="v9"), LIVE) == "v1"
    assert choose_version("u", "", VersionPolicy(), LIVE) == "v1"
    # A tie goes to the greatest version string; versions with no ranker do not count.
    assert choose_version("u", "", VersionPolicy(), {"a": 2, "b": 2, "c": 0}) == "b"
    assert choose_version("u", "", VersionPolicy(current="v1"), {}) is None
    canary_gone = VersionPolicy(current="v9", canary="v8", canary_fraction=1.0)
    assert choose_version("u", "", canary_gone, {"v1": 1, "v2": 1}) == "v2"


def test_the_canary_fraction_holds_over_many_users_and_is_stable_per_user(
    rng: np.random.Generator,
) -> None:
    users = [f"user-{n}" for n in rng.integers(0, 2**62, size=20_000)]
    for fraction in (0.0, 0.05, 0.3, 1.0):
        policy = VersionPolicy(current="v1", canary="v2", canary_fraction=fraction)
        chosen = Counter(choose_version(u, "", policy, LIVE) for u in users)
        # Binomial: 5 standard deviations at most 0.018 of 20,000 users.
        assert abs(chosen["v2"] / len(users) - fraction) <= 0.018, (fraction, chosen)
        assert chosen["v1"] + chosen["v2"] == len(users)
    # The same user always lands on the same side; widening the canary only adds users.
    five = {u for u in users if canary_point(u) < 0.05}
    ten = {u for u in users if canary_point(u) < 0.10}
    assert five < ten
    assert all(0.0 <= canary_point(u) < 1.0 for u in users)
    # Fixed values: every process (router, trigger), run after run, places a user the same.
    assert (canary_point("alice"), canary_point("bob")) == (0.6783578631809686, 0.5626898393333264)


# -- the policy ------------------------------------------------------------------------------


def test_the_policy_parses_from_json_and_round_trips() -> None:
    raw = b'{"current": "v1", "canary": "v2", "canary_fraction": 0.05}'
    policy = VersionPolicy.from_json(raw)
    assert policy == VersionPolicy("v1", "v2", 0.05)
    assert VersionPolicy.from_json(policy.to_json()) == policy
    assert VersionPolicy.from_json(b'{"canary": "v2", "canary_fraction": 1}').canary_fraction == 1.0
    assert VersionPolicy.from_json(b"{}") == VersionPolicy()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{", "not valid JSON"),
        (b"[1]", "expected a JSON object, got list"),
        (b'{"curent": "v1"}', "unknown keys \\['curent'\\]; valid keys are"),
        (b'{"canary": "v2", "canary_fraction": 1.5}', "canary_fraction must be in \\[0, 1\\]"),
        (b'{"canary": "v2", "canary_fraction": -0.1}', "canary_fraction must be in \\[0, 1\\]"),
        (b'{"canary_fraction": 0.1}', "canary_fraction > 0 needs a canary version"),
        (b'{"canary": "v2", "canary_fraction": "0.1"}', "canary_fraction must be a number"),
        (b'{"canary": "v2", "canary_fraction": true}', "canary_fraction must be a number"),
        (b'{"current": 1}', "current must be a string"),
        (b'{"current": "v/1"}', "current must not contain '/'"),
    ],
)
def test_a_bad_policy_is_a_config_error_naming_what_is_wrong(raw: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        VersionPolicy.from_json(raw)


# -- a version's rankers ---------------------------------------------------------------------


def test_serving_keeps_only_the_versions_rankers_and_live_versions_counts_them() -> None:
    view = {r.instance_id: r for r in (ranker("a", "v1"), ranker("b", "v2"), ranker("c", "v1"))}
    assert sorted(serving(view, "v1")) == ["a", "c"] and serving(view, "v3") == {}
    assert live_versions(view) == {"v1": 2, "v2": 1}
    assert unavailable_message("v3", live_versions(view)) == (
        "no live ranker serves model version 'v3'; live versions (rankers): v1 (2), v2 (1)"
    )
    assert unavailable_message("v3", {}).endswith("live versions (rankers): none")


# -- live config -----------------------------------------------------------------------------


def test_the_live_policy_applies_valid_values_keeps_the_last_on_bad_ones_and_resets_on_delete(
    caplog: pytest.LogCaptureFixture,
) -> None:
    applied: list[VersionPolicy] = []
    live = live_policy("/relaygr/", applied.append, logging.getLogger("tests.versions"))
    assert live.key == versions_key("/relaygr") == "/relaygr/config/versions"

    def put(value: bytes, key: str = live.key) -> None:
        live.on_event(WatchEvent(EventKind.PUT, key, value, 1))

    put(b'{"current": "v1", "canary": "v2", "canary_fraction": 0.1}')
    good = VersionPolicy("v1", "v2", 0.1)
    assert live.current == good and applied == [good]
    with caplog.at_level(logging.WARNING, logger="tests.versions"):
        for value in (b'{"canary_fraction": 2}', b"[]", b"{"):
            put(value)
    assert live.rejected == 3 and live.current == good and applied == [good]
    assert "canary_fraction must be in [0, 1]" in caplog.text
    put(b'{"current": "v9"}', key=live.key + "-other")  # another key under the prefix
    assert live.current == good
    live.on_event(WatchEvent(EventKind.DELETE, live.key, None, 2))
    assert live.current == VersionPolicy() and applied[-1] == VersionPolicy()


def test_the_version_index_splits_a_view_and_is_kept_until_the_view_changes() -> None:
    view = {"a": ranker("a", "v1"), "b": ranker("b", "v2"), "c": ranker("c", "v1")}
    indexer = VersionIndexer()
    index = indexer(view)
    assert index.live == live_versions(view)
    assert dict(index.serving("v1")) == serving(view, "v1") and dict(index.serving("v3")) == {}
    assert index.serving_ids("v1") == {"a", "c"} and index.serving_ids("v3") == frozenset()
    assert indexer(view) is index  # the same view object: the same index
    changed = {**view, "d": ranker("d", "v2")}  # membership changes by a new snapshot
    assert indexer(changed) is not index
    assert indexer(changed).live == {"v1": 2, "v2": 2}
