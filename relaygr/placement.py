"""Affinity placement policy: rendezvous hashing of users over live rankers, with bounded load."""

import enum
import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass

import numpy as np


class Reason(enum.StrEnum):
    """Why a PreInfer landed where it did (carried on the router's span)."""

    HASH = "hash"  # the user's plain rendezvous owner
    SPILLED = "spilled"  # the owner was over the load bound; a later instance in the order took it
    DIRECTORY = "directory"  # the directory records where the user's cache lives
    PREFERRED = "preferred"  # the sender (the trigger) found relay room there
    ROOM = "room"  # the instances before it in the order have no relay room, as far as known


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a PreInfer goes and what to try if that instance fails.

    `order[0] == instance`; the rest is the user's ranking without it, so a failed instance is
    followed by the next-preferred one. `owner` is the plain hash owner (`ranking(...)[0]`);
    whether the directory must learn where the user went is `directory_write`'s call.
    """

    instance: str
    reason: Reason
    order: tuple[str, ...]
    owner: str


def weight(user: str, instance: str) -> int:
    """The user's 64-bit rendezvous weight for an instance; the same in every process.

    splitmix64's finaliser of h(user) XOR h(instance), h a keyed 64-bit BLAKE2b of the name:
    each name is hashed once (an instance's hash is kept), so ranking a user over n instances
    costs one BLAKE2b and n multiply-xor rounds, vectorised, instead of n BLAKE2bs.
    """
    mixed = _mix(np.array([_h64(user) ^ _h64(instance)], dtype=np.uint64))
    return int(mixed[0])


def ranking(user: str, instances: Iterable[str]) -> list[str]:
    """The user's preference order over distinct instances: highest weight first.

    Ties (vanishingly rare at 64 bits) break by instance id, so the order never depends on the
    order of `instances`. A user's order is kept for its next requests (a bounded LRU): a
    request is routed more than once within seconds (trigger, PreInfer, Rank).
    """
    members = _MEMBERS.get(frozenset(instances))  # a frozenset is itself, its hash kept
    if not len(members.names):
        return []
    key = (user, members.number)
    order = _ORDERS.get(key)
    if order is None:
        weights = _mix(members.hashes ^ np.uint64(_h64(user)))
        # Descending weight; a stable sort keeps equal weights in ascending id order.
        order = np.argsort(~weights, kind="stable").astype(_index_type(len(members.names)))
        _ORDERS.put(key, order)
    return members.names[order].tolist()


class _Orders:
    """Recent users' orders, each as indices into its instance set's ascending ids, least
    recently used dropped first once they hold more than `slots` indices in all. A user's order
    has one index per instance, so the bound is on indices, not users: the memory held stays
    about the same whatever the fleet's size (fewer users are kept over more instances)."""

    def __init__(self, slots: int) -> None:
        self._slots = slots
        self.held = 0  # indices in the orders kept
        self._orders: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._orders)

    def get(self, key: tuple[str, int]) -> np.ndarray | None:
        order = self._orders.get(key)
        if order is not None:
            self._orders.move_to_end(key)
        return order

    def put(self, key: tuple[str, int], order: np.ndarray) -> None:
        self._orders[key] = order
        self.held += len(order)
        while self.held > self._slots:
            _, dropped = self._orders.popitem(last=False)
            self.held -= len(dropped)


def _index_type(instances: int) -> type[np.signedinteger]:
    """The narrowest index type for a set of `instances` ids (2 bytes up to 32,767)."""
    return np.int16 if instances <= np.iinfo(np.int16).max else np.int32


# 2^22 indices (2 bytes each up to 32,767 instances): measured with their keys and arrays,
# 22 MiB a process for 41,943 users' orders over 100 instances, 9 MiB for 4,194 over 1,000
# (65,536 users' orders, whatever the fleet, would hold 273 MiB over 1,000). Enough for the
# last seconds of a router's users, so a user's trigger, PreInfer and Rank find its order.
# Placement is decided on a service's event loop (or the simulator's clock), never from two
# threads, so the caches take no lock.
_ORDERS = _Orders(slots=1 << 22)


_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (multiplication wraps mod 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * _MULTIPLIERS[0]
    x = (x ^ (x >> np.uint64(27))) * _MULTIPLIERS[1]
    return x ^ (x >> np.uint64(31))


def _h64(name: str) -> int:
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=b"relaygr-hrw").digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True, slots=True)
class _Set:
    names: np.ndarray  # the ids, ascending, as objects: an order's indices gather them at once
    hashes: np.ndarray
    number: int  # never reused: orders cached for it can never be mistaken for another set's


class _Members:
    """Instance sets seen lately, each as its ids in ascending order and their hashes (a
    router sees few distinct memberships: one until a ranker joins or leaves)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._sets: OrderedDict[frozenset[str], _Set] = OrderedDict()
        self._numbers = itertools.count()

    def get(self, live: frozenset[str]) -> _Set:
        held = self._sets.pop(live, None)
        if held is not None:
            # Kept under this set object from now (and last used): a caller that passes the
            # same object again (`VersionIndex.serving_ids`) is found by identity, not by
            # comparing every id with an equal set's.
            self._sets[live] = held
            return held
        names = sorted(live)
        hashes = np.array([_h64(n) for n in names], dtype=np.uint64)
        held = _Set(np.array(names, dtype=object), hashes, next(self._numbers))
        self._sets[live] = held
        while len(self._sets) > self._keep:
            self._sets.popitem(last=False)
        return held


_MEMBERS = _Members(keep=16)


def load_bound(
    loads: Mapping[str, float], instances: Iterable[str], epsilon: float, floor: float = 1.0
) -> int:
    """The most load any live instance may carry once one more user is placed.

    ceil((1 + epsilon) * max(mean, floor)), the mean taken over the live instances after adding
    the user (absent loads count as 0). Below `floor` nobody is overloaded: balancing a handful
    of relays would only turn hashing noise into spills (and directory writes). The ceiling (as
    in Mirrokni et al.'s consistent hashing with bounded loads) guarantees that, with integer
    loads, some instance always fits: the loads sum to less than n * bound before the user is
    added.
    """
    live = frozenset(instances)  # a frozenset is itself: no copy
    if not live:
        return 0
    mean = (sum(map(loads.get, live, itertools.repeat(0.0))) + 1) / len(live)
    return math.ceil((1 + epsilon) * max(mean, floor))


def place(
    user: str,
    instances: Iterable[str],
    loads: Mapping[str, float],
    epsilon: float,
    directory: Mapping[str, str],
    floor: float = 1.0,
) -> Placement | None:
    """Where the user's PreInfer goes; None when no instance is live (the caller's UNAVAILABLE).

    A directory entry naming a live instance wins while that instance's load + 1 is within
    `load_bound`: the user's cache is there. Otherwise (no entry, or its instance is full) the
    first instance in the user's ranking whose load + 1 is within the bound takes it, so with
    integer loads no instance ever passes the bound, hot users included; if none fits (possible
    only with fractional loads), the least-loaded does, earliest in the ranking among equals.
    """
    live = frozenset(instances)  # once, for the ranking and the bound
    order = ranking(user, live)
    if not order:
        return None
    owner = order[0]
    bound = load_bound(loads, live, epsilon, floor)
    recorded = directory.get(user)
    if recorded is not None and recorded in order and loads.get(recorded, 0.0) + 1 <= bound:
        return _placement(recorded, Reason.DIRECTORY, order, owner)
    chosen = next((inst for inst in order if loads.get(inst, 0.0) + 1 <= bound), None)
    if chosen is None:
        chosen = min(order, key=lambda inst: loads.get(inst, 0.0))
    return _placement(chosen, Reason.HASH if chosen == owner else Reason.SPILLED, order, owner)


def with_room(placement: Placement, preferred: str, full: Container[str]) -> Placement:
    """The placement of a relay that should land where there is room.

    `preferred` (empty: none), when it is in the order, goes first: the sender found room
    there. The instances in `full` move to the end of the order, still tried last (rankers have
    the final word on room). The owner and, unless the first instance changed, the reason stay.
    """
    order = list(placement.order)
    first = [inst for inst in order if inst not in full] + [inst for inst in order if inst in full]
    if preferred in order:
        first.remove(preferred)
        first.insert(0, preferred)
    if first[0] == placement.instance:
        reason = placement.reason
    else:
        reason = Reason.PREFERRED if first[0] == preferred else Reason.ROOM
    return Placement(first[0], reason, tuple(first), placement.owner)


def route_rank(user: str, instances: Iterable[str], directory: Mapping[str, str]) -> list[str]:
    """The order a Rank tries instances: the directory's live instance, then the ranking.

    No load check: a Rank follows its PreInfer's placement. Empty when no instance is live.
    """
    order = ranking(user, instances)
    recorded = directory.get(user)
    if recorded is not None and recorded in order:
        order.remove(recorded)
        order.insert(0, recorded)
    return order


def shuffled(instances: Iterable[str], draw: Callable[[int], int]) -> list[str]:
    """The instances in a random order (`draw(n)` returns an int in [0, n)): the ablation that
    places PreInfer and Rank without affinity."""
    pool = sorted(set(instances))
    order = []
    while pool:
        order.append(pool.pop(draw(len(pool))))
    return order


def directory_write(
    served: str, owner: str, entry: tuple[str, float] | None, now: float, window_s: float
) -> bool:
    """Must the directory be told that the user's cache now lives on `served`?

    `entry` is the user's live entry as (instance, expires_at), or None. A user on its hash
    owner needs an entry only to overwrite one naming another instance; a user elsewhere needs
    one unless the entry already names `served` for at least half a window more. A hot user's
    repeated PreInfers thus rewrite its entry at most twice per window, not once per request.
    """
    if served == owner:
        return entry is not None and entry[0] != served
    return entry is None or entry[0] != served or entry[1] - now < window_s / 2


def _placement(chosen: str, reason: Reason, order: list[str], owner: str) -> Placement:
    rest = order.copy()
    rest.remove(chosen)  # the ids are distinct
    return Placement(chosen, reason, (chosen, *rest), owner)
