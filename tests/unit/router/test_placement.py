"""Placement policy: rendezvous determinism and consistency, bounded load, directory, Rank order."""

import collections
import math
import random

import numpy as np
import pytest

from relaygr.placement import (
    Placement,
    Reason,
    _Orders,
    directory_write,
    load_bound,
    place,
    ranking,
    route_rank,
    shuffled,
    weight,
)

INSTANCES = [f"ranker-{i}" for i in range(10)]
USERS = [f"user-{i}" for i in range(2000)]


def owners(instances: list[str]) -> dict[str, str]:
    return {u: ranking(u, instances)[0] for u in USERS}


def owned_by(instance: str, others: list[str]) -> str:
    """A user whose hash owner among `others + [instance]` is `instance`."""
    return next(u for u in USERS if ranking(u, [*others, instance])[0] == instance)


# -- rendezvous hashing --------------------------------------------------------------------


def test_weight_is_pinned() -> None:
    # Routers of different versions and processes must agree: the scheme is fixed, not `hash`.
    assert weight("alice", "ranker-0") == 0x145654A6B44620C4
    assert ranking("alice", ["ranker-0", "ranker-1", "ranker-2"]) == [
        "ranker-1",
        "ranker-2",
        "ranker-0",
    ]


def test_ranking_orders_by_weight_then_id() -> None:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(50):
        user = f"user-{rng.randrange(10**9)}"
        instances = [f"r{rng.randrange(10**6)}" for _ in range(rng.randrange(1, 40))]
        expected = sorted(set(instances), key=lambda i: (-weight(user, i), i))
        assert ranking(user, instances) == expected


def test_ranking_is_deterministic_and_ignores_instance_order() -> None:
    shuffled = INSTANCES[:]
    random.Random(7).shuffle(shuffled)
    for user in USERS[:200]:
        first = ranking(user, INSTANCES)
        assert sorted(first) == sorted(INSTANCES)
        assert ranking(user, INSTANCES) == first
        assert ranking(user, reversed(INSTANCES)) == first
        assert ranking(user, shuffled) == first
        assert ranking(user, [*INSTANCES, INSTANCES[0]]) == first  # duplicates collapse
        # A set of the ids (as `VersionIndex.serving_ids` keeps them), and an equal one.
        assert ranking(user, frozenset(INSTANCES)) == first
        assert ranking(user, frozenset(shuffled)) == first


def test_orders_kept_stay_within_their_index_budget_whatever_the_fleet_size() -> None:
    # A user's order holds one index per instance, so the cache is bounded in indices: a large
    # fleet keeps fewer users' orders, not more memory (kept by count of users, a process held
    # 273 MiB of orders over 1,000 instances).
    orders = _Orders(slots=10_000)
    for n in (10, 1_000):
        for i in range(200):
            orders.put((f"user-{i}", n), np.arange(n, dtype=np.int16))
            assert orders.held <= 10_000
    assert len(orders) == 10, "the last ten users' orders over 1,000 instances"
    assert orders.get(("user-199", 1_000)) is not None
    assert orders.get(("user-189", 1_000)) is None


def test_ranking_over_more_instances_than_a_short_index_holds() -> None:
    instances = [f"r{i}" for i in range(40_000)]  # past int16's 32,767
    order = ranking("alice", instances)
    assert sorted(order) == sorted(instances)
    assert order[0] == max(instances, key=lambda i: weight("alice", i))
    assert ranking("alice", instances) == order, "the kept order reads back the same"


def test_adding_an_instance_moves_only_users_it_wins() -> None:
    before = owners(INSTANCES)
    after = owners([*INSTANCES, "ranker-new"])
    moved = [u for u in USERS if after[u] != before[u]]
    assert all(after[u] == "ranker-new" for u in moved)
    expected = len(USERS) / (len(INSTANCES) + 1)  # ~182; binomial sd ~13
    assert abs(len(moved) - expected) < 0.3 * expected


def test_removing_an_instance_moves_only_its_users() -> None:
    before = owners(INSTANCES)
    gone = INSTANCES[3]
    after = owners([i for i in INSTANCES if i != gone])
    for user in USERS:
        if before[user] == gone:
            assert after[user] == ranking(user, INSTANCES)[1]  # its next choice
        else:
            assert after[user] == before[user]


# -- bounded load --------------------------------------------------------------------------


@pytest.mark.parametrize("in_flight", [None, 400], ids=["resident", "in-flight"])
def test_zipf_stream_never_exceeds_the_bound(
    rng: np.random.Generator, in_flight: int | None
) -> None:
    """5,000 placements of Zipf-skewed users; `in_flight` caps live load by random completions."""
    instances, epsilon = INSTANCES[:8], 0.25
    loads: collections.Counter[str] = collections.Counter()
    live: list[str] = []
    reasons: collections.Counter[Reason] = collections.Counter()
    for k in rng.zipf(1.2, size=5000):
        user = f"user-{k}"
        bound = math.ceil((1 + epsilon) * max((sum(loads.values()) + 1) / len(instances), 1))
        p = place(user, instances, loads, epsilon, {})
        assert p is not None
        order = ranking(user, instances)
        # the first instance in the user's order that fits, each one before it over the bound
        assert loads[p.instance] + 1 <= bound
        skipped = order[: order.index(p.instance)]
        assert all(loads[i] + 1 > bound for i in skipped)
        assert p.order == (p.instance, *skipped, *order[len(skipped) + 1 :])
        assert p.owner == order[0]
        assert (p.reason is Reason.SPILLED) == (p.instance != order[0])
        reasons[p.reason] += 1
        loads[p.instance] += 1
        live.append(p.instance)
        if in_flight is None:
            assert max(loads.values()) <= bound  # the bound only grows: a global invariant
        elif len(live) > in_flight:
            loads[live.pop(int(rng.integers(len(live))))] -= 1
    assert reasons[Reason.SPILLED] > 0 and reasons[Reason.HASH] > 0
    assert reasons[Reason.DIRECTORY] == 0


def test_bound_is_ceiling_of_one_plus_epsilon_times_mean_after_adding() -> None:
    assert load_bound({"a": 1, "b": 1}, ["a", "b"], 0.25) == 2  # ceil(1.25 * 1.5)
    assert load_bound({"a": 9, "b": 9, "gone": 100}, ["a", "b"], 0.5) == 15  # ceil(1.5 * 9.5)
    assert load_bound({}, ["a", "b", "c"], 0.25) == 2  # the mean is floored at 1
    assert load_bound({}, [], 0.25) == 0


def test_owner_at_the_bound_spills_to_the_next_in_order() -> None:
    user = "alice"
    owner, second = ranking(user, ["a", "b"])
    assert place(user, ["a", "b"], {owner: 1, second: 1}, 0.25, {}) == Placement(
        owner, Reason.HASH, (owner, second), owner
    )
    assert place(user, ["a", "b"], {owner: 2, second: 0}, 0.25, {}) == Placement(
        second, Reason.SPILLED, (second, owner), owner
    )


def test_fractional_loads_with_no_fit_take_the_least_loaded() -> None:
    user = "alice"
    owner, second = ranking(user, ["a", "b"])
    # bound = ceil(1.0 * 5.7 / 2) = 3; 2.5 + 1 and 2.2 + 1 are both over it
    p = place(user, ["a", "b"], {owner: 2.5, second: 2.2}, 0.0, {})
    assert load_bound({owner: 2.5, second: 2.2}, ["a", "b"], 0.0) == 3
    assert p == Placement(second, Reason.SPILLED, (second, owner), owner)


# -- directory -----------------------------------------------------------------------------


def test_live_directory_entry_wins_while_its_instance_is_within_the_bound() -> None:
    user = "alice"
    order = ranking(user, INSTANCES)
    recorded = order[4]
    p = place(user, INSTANCES, {order[0]: 3}, 0.25, {user: recorded, "bob": order[0]})
    expected_order = (recorded, *order[:4], *order[5:])
    assert p == Placement(recorded, Reason.DIRECTORY, expected_order, order[0])
    p = place(user, INSTANCES, {}, 0.25, {user: order[0]})
    assert p == Placement(order[0], Reason.DIRECTORY, tuple(order), order[0])


def test_directory_entry_on_a_full_instance_yields_to_bounded_placement() -> None:
    user = "alice"
    order = ranking(user, INSTANCES)
    recorded = order[4]
    loads = {recorded: 1_000}  # bound = ceil(1.25 * 1001 / 8) = 157
    p = place(user, INSTANCES, loads, 0.25, {user: recorded})
    assert p == Placement(order[0], Reason.HASH, tuple(order), order[0])


def test_directory_write_follows_placement_changes_not_requests() -> None:
    window, now = 2.0, 100.0
    # on its hash owner: only a stale entry elsewhere needs overwriting
    assert not directory_write("a", "a", None, now, window)
    assert not directory_write("a", "a", ("a", now + 0.1), now, window)
    assert directory_write("a", "a", ("b", now + 1.9), now, window)
    # elsewhere: written when missing, different or within half a window of expiring
    assert directory_write("b", "a", None, now, window)
    assert directory_write("b", "a", ("c", now + 1.9), now, window)
    assert directory_write("b", "a", ("b", now + 0.99), now, window)
    assert not directory_write("b", "a", ("b", now + 1.0), now, window)


def test_zipf_stream_with_a_directory_keeps_every_instance_within_the_bound(
    rng: np.random.Generator,
) -> None:
    """Hot users come back while pinned by the directory: the bound still holds everywhere, and
    a user's entry is rewritten when its location changes or twice a window, not per request."""
    instances, epsilon, window, steps = INSTANCES[:4], 0.25, 50, 3000
    loads: collections.Counter[str] = collections.Counter()  # placements in the last window
    recent: collections.deque[str] = collections.deque()
    directory: dict[str, tuple[str, float]] = {}
    reasons: collections.Counter[Reason] = collections.Counter()
    writes: collections.Counter[str] = collections.Counter()
    moves: collections.Counter[str] = collections.Counter()
    for now, k in enumerate(rng.zipf(1.1, size=steps)):
        user = f"user-{k}"
        live = {u: e for u, e in directory.items() if e[1] > now}
        p = place(user, instances, loads, epsilon, {u: e[0] for u, e in live.items()}, 2.0)
        assert p is not None
        bound = load_bound(loads, instances, epsilon, 2.0)
        loads[p.instance] += 1
        recent.append(p.instance)
        assert max(loads.values()) <= bound
        if len(recent) > window:
            loads[recent.popleft()] -= 1
        reasons[p.reason] += 1
        moves[user] += p.instance != (live[user][0] if user in live else p.owner)
        if directory_write(p.instance, p.owner, live.get(user), now, window):
            directory[user] = (p.instance, now + window)
            writes[user] += 1
    assert reasons[Reason.DIRECTORY] > 0 and reasons[Reason.SPILLED] > 0, reasons
    for user, count in writes.items():
        assert count <= moves[user] + steps / (window / 2) + 1, (user, count, moves[user])
    hottest = max(writes, key=writes.__getitem__)
    print(f"hottest user: {writes[hottest]} writes, {moves[hottest]} moves, {steps} steps")


def test_directory_entry_for_a_dead_instance_is_ignored() -> None:
    user = "alice"
    p = place(user, INSTANCES, {}, 0.25, {user: "ranker-dead"})
    order = ranking(user, INSTANCES)
    assert p == Placement(order[0], Reason.HASH, tuple(order), order[0])


def test_route_rank_follows_the_directory_then_the_ranking() -> None:
    user = "alice"
    order = ranking(user, INSTANCES)
    assert route_rank(user, INSTANCES, {}) == order
    assert route_rank(user, INSTANCES, {user: order[2]}) == [order[2], *order[:2], *order[3:]]
    assert route_rank(user, INSTANCES, {user: "ranker-dead"}) == order
    assert route_rank(user, INSTANCES, {"bob": order[2]}) == order


def test_rank_follows_a_spilled_preinfer() -> None:
    user = owned_by("b", ["a"])
    p = place(user, ["a", "b"], {"b": 5}, 0.25, {})
    assert p is not None and p.instance == "a" and p.owner == "b"
    assert route_rank(user, ["a", "b"], {user: p.instance}) == ["a", "b"]


def test_no_live_instances() -> None:
    assert ranking("alice", []) == []
    assert place("alice", [], {"a": 1}, 0.25, {"alice": "a"}) is None
    assert route_rank("alice", [], {"alice": "a"}) == []


def test_shuffled_is_a_permutation_and_reaches_every_order(rng: np.random.Generator) -> None:
    instances = ["a", "b", "c"]
    seen = set()
    for _ in range(300):
        order = shuffled([*instances, "a"], lambda n: int(rng.integers(n)))
        assert sorted(order) == instances  # each live instance once, duplicates ignored
        seen.add(tuple(order))
    assert len(seen) == 6
    assert shuffled([], lambda n: 0) == []
