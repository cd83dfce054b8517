"""Prefix digests: any content change alters them; appending pieces equals hashing whole."""

import numpy as np

from relaygr.behaviours import Behaviours
from services.ranker.digest import PrefixHasher, prefix_digest

from .factories import prefix


def test_any_change_to_the_prefix_changes_the_digest(rng: np.random.Generator) -> None:
    p = prefix(rng, 50, n_user=4)
    base = prefix_digest(p.user_features, p.long_term)
    at = int(rng.integers(0, 50))

    def changed(column: str, delta: int) -> Behaviours:
        arrays = {
            "item_ids": p.long_term.item_ids.copy(),
            "actions": p.long_term.actions.copy(),
            "timestamps": p.long_term.timestamps.copy(),
        }
        arrays[column][at] += delta
        return Behaviours(**arrays)

    features = p.user_features.copy()
    features[int(rng.integers(0, 4))] += 1
    variants = [
        prefix_digest(p.user_features, changed("item_ids", 1)),
        prefix_digest(p.user_features, changed("actions", 1)),
        prefix_digest(p.user_features, changed("timestamps", 1)),
        prefix_digest(features, p.long_term),
        prefix_digest(p.user_features, p.long_term.slice(0, 49)),
        prefix_digest(p.user_features[:3], p.long_term),
        # The boundary between user features and behaviours is part of the content.
        prefix_digest(np.append(p.user_features, p.long_term.item_ids[0]), p.long_term),
    ]
    assert base not in variants
    assert len(set(variants)) == len(variants)
    assert prefix_digest(p.user_features.copy(), p.long_term.slice(0)) == base


def test_incremental_digest_equals_whole(rng: np.random.Generator) -> None:
    p = prefix(rng, 100)
    hasher = PrefixHasher.start(p.user_features)
    start_digest = hasher.digest()
    for start, stop in ((0, 1), (1, 40), (40, 40), (40, 100)):
        hasher = hasher.absorb(p.long_term.slice(start, stop))
    assert hasher.digest() == prefix_digest(p.user_features, p.long_term)
    # absorb never mutates the hasher it was called on
    assert PrefixHasher.start(p.user_features).digest() == start_digest
