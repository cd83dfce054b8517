"""Token embeddings: hashed item ids, actions and user-profile features."""

import numpy as np
import torch
from torch import nn

from relaygr.behaviours import Behaviours, Int64Array
from services.ranker.model_config import ModelConfig

CANDIDATE_ACTION = 0
# User-profile tokens carry no time: placed at the earliest representable instant, their time
# bias with any behaviour falls in the farthest bucket, and 0 among themselves.
UNTIMED = -(1 << 62)


def mix64(values: Int64Array, salt: int = 0) -> Int64Array:
    """SplitMix64 finaliser over uint64 (wrap-around is defined there), returned as int64 >= 0."""
    x = values.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (salt + 1)) % (1 << 64))
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(1)).astype(np.int64)


class TokenEmbedding(nn.Module):
    """Maps user features, behaviours and candidates to d_model vectors.

    A behaviour is its hashed item plus its action; a candidate is its hashed item plus the
    reserved candidate action; user feature i is its hashed (slot, value) plus a slot embedding.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.items = nn.Embedding(cfg.item_buckets, cfg.d_model)
        self.actions = nn.Embedding(cfg.num_actions, cfg.d_model)
        self.user_values = nn.Embedding(cfg.user_feature_buckets, cfg.d_model)
        self.user_slots = nn.Embedding(max(cfg.max_user_features, 1), cfg.d_model)

    def _index(self, array: Int64Array) -> torch.Tensor:
        return torch.from_numpy(array).to(self.items.weight.device)

    def user(self, features: Int64Array) -> torch.Tensor:
        slots = np.arange(len(features), dtype=np.int64)
        buckets = mix64(features ^ (slots << np.int64(56)), salt=1) % self.cfg.user_feature_buckets
        return self.user_values(self._index(buckets)) + self.user_slots(self._index(slots))

    def behaviours(self, behaviours: Behaviours) -> torch.Tensor:
        buckets = mix64(behaviours.item_ids) % self.cfg.item_buckets
        return self.items(self._index(buckets)) + self.actions(self._index(behaviours.actions))

    def candidates(self, item_ids: Int64Array) -> torch.Tensor:
        buckets = mix64(item_ids) % self.cfg.item_buckets
        action = self.actions.weight[CANDIDATE_ACTION]
        return self.items(self._index(buckets)) + action
