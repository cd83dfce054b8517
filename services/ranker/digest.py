"""Content digest of a prefix [U, S_l], computable incrementally as behaviours are appended."""

import hashlib
from typing import NewType

import numpy as np

from relaygr.behaviours import Behaviours, Int64Array

# A model's content-derived version: one dimension of every cache key.
ModelVersion = NewType("ModelVersion", str)

PrefixDigest = NewType("PrefixDigest", str)


class PrefixHasher:
    """Streaming digest over the user features and then the behaviour records, in order.

    Records are absorbed row by row (item, action, ts), so hashing a sequence in any number of
    appended pieces gives the digest of hashing it whole: `extend` can carry the digest forward
    without the earlier behaviours. Instances are never mutated once shared: `absorb` returns a
    new hasher.
    """

    __slots__ = ("_state",)

    def __init__(self, state: "hashlib.blake2b") -> None:
        self._state = state

    @classmethod
    def start(cls, user_features: Int64Array) -> "PrefixHasher":
        state = hashlib.blake2b(digest_size=16, person=b"relaygr-prefix1")
        state.update(np.int64(len(user_features)).tobytes())
        state.update(np.ascontiguousarray(user_features, dtype="<i8").tobytes())
        return cls(state)

    def absorb(self, behaviours: Behaviours) -> "PrefixHasher":
        state = self._state.copy()
        if len(behaviours):
            state.update(np.ascontiguousarray(behaviours.records(), dtype="<i8").tobytes())
        return PrefixHasher(state)

    def digest(self) -> PrefixDigest:
        return PrefixDigest(self._state.hexdigest())

    @classmethod
    def sealed(cls, digest: PrefixDigest) -> "PrefixHasher":
        """A hasher that knows only its `digest`: that of a prefix received from a peer, whose
        inputs this process never saw. It cannot absorb more; a request that extends such a
        prefix rebuilds the hasher from its own inputs (which it checks against the digest)."""
        return _Sealed(digest)


class _Sealed(PrefixHasher):
    __slots__ = ("_digest",)

    def __init__(self, digest: PrefixDigest) -> None:
        self._digest = digest

    def absorb(self, behaviours: Behaviours) -> PrefixHasher:
        raise ValueError("a received prefix's hasher is sealed: rebuild it from the prefix inputs")

    def digest(self) -> PrefixDigest:
        return self._digest


def prefix_digest(user_features: Int64Array, long_term: Behaviours) -> PrefixDigest:
    return PrefixHasher.start(user_features).absorb(long_term).digest()
