"""The ranking model's one frozen configuration object and its validation."""

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from relaygr.config import require_positive
from relaygr.errors import ConfigError

if TYPE_CHECKING:
    import torch


TIMESTAMP_BYTES = 8  # a cached prefix token keeps its int64 timestamp for the time bias


class KVDtype(StrEnum):
    """Storage dtype of cached K/V; compute stays float32 whatever is stored.

    This module does not import torch at run time, so services that only read model shapes
    (trigger, router) stay light.
    """

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def element_bytes(self) -> int:
        return 4 if self is KVDtype.FLOAT32 else 2

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return {
            KVDtype.FLOAT32: torch.float32,
            KVDtype.BFLOAT16: torch.bfloat16,
            KVDtype.FLOAT16: torch.float16,
        }[self]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and limits of the HSTU ranking model.

    The defaults size the model so that full inference over a 4k-token history with 256
    candidates takes a few hundred milliseconds on two CPU cores (see docs/benchmarks.md).
    """

    num_layers: int = 3
    d_model: int = 512
    num_heads: int = 2
    d_qk: int = 64  # per head
    d_v: int = 128  # per head; heads * d_v is the width of U, V and the attention output
    ffn_mult: int = 4  # hidden width of the pointwise feed-forward block; 0 disables it
    item_buckets: int = 1 << 15
    user_feature_buckets: int = 1 << 12
    num_actions: int = 16  # action 0 is reserved for candidates
    num_position_buckets: int = 64
    num_time_buckets: int = 64
    tasks: tuple[str, ...] = ("click", "like")
    max_user_features: int = 32
    max_history_tokens: int = 16384  # user features + long-term + short-term behaviours
    max_candidates: int = 1024
    attention_block: int = 512  # query rows per attention block (bounds the score buffer)
    kv_dtype: KVDtype = KVDtype.FLOAT32

    def __post_init__(self) -> None:
        positive = (
            "num_layers", "d_model", "num_heads", "d_qk", "d_v", "item_buckets",
            "user_feature_buckets", "num_position_buckets", "num_time_buckets",
            "max_history_tokens", "max_candidates", "attention_block",
        )  # fmt: skip
        require_positive(self, positive, "model config")
        if self.ffn_mult < 0:
            raise ConfigError(f"model config ffn_mult must be >= 0, got {self.ffn_mult}")
        if self.num_actions < 2:
            raise ConfigError(f"model config num_actions must be >= 2, got {self.num_actions}")
        if self.max_user_features < 0:
            raise ConfigError("model config max_user_features must be >= 0")
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"model config tasks must be non-empty and unique, got {self.tasks}")
        if not isinstance(self.kv_dtype, KVDtype):
            object.__setattr__(self, "kv_dtype", parse_kv_dtype(str(self.kv_dtype)))

    @property
    def k_bytes_per_token(self) -> int:
        """Bytes of one cached prefix token's keys: every layer and head, d_qk wide, stored."""
        return self.num_layers * self.num_heads * self.d_qk * self.kv_dtype.element_bytes

    @property
    def v_bytes_per_token(self) -> int:
        """Bytes of one cached prefix token's values: every layer and head, d_v wide, stored."""
        return self.num_layers * self.num_heads * self.d_v * self.kv_dtype.element_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one cached prefix token holds in K and V: every layer, in the storage dtype."""
        return self.k_bytes_per_token + self.v_bytes_per_token

    @property
    def cache_bytes_per_token(self) -> int:
        """Bytes one cached prefix token charges a KV tier: its K/V plus its int64 timestamp."""
        return self.kv_bytes_per_token + TIMESTAMP_BYTES

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tasks"] = list(self.tasks)
        data["kv_dtype"] = self.kv_dtype.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys {unknown}; valid keys: {sorted(known)}")
        values = dict(data)
        if "tasks" in values:
            values["tasks"] = tuple(values["tasks"])
        if "kv_dtype" in values:
            values["kv_dtype"] = parse_kv_dtype(str(values["kv_dtype"]))
        return cls(**values)


def parse_kv_dtype(value: str) -> KVDtype:
    try:
        return KVDtype(value)
    except ValueError as err:
        valid = ", ".join(d.value for d in KVDtype)
        raise ConfigError(f"kv_dtype {value!r} is not one of: {valid}") from err


class ModelPreset(StrEnum):
    """Named model shapes (`PRESETS`): `relaygr ranker --model`, `relaygr up --model`."""

    TINY = "tiny"
    SMALL = "small"
    DEFAULT = "default"


# The one definition of each shape the tests, the demo and the benchmarks use.
PRESETS: dict[ModelPreset, ModelConfig] = {
    # The tests': fast, with attention blocks small enough that a history spans several, and
    # tight input limits (8 user features, 4,096 history tokens, 64 candidates).
    ModelPreset.TINY: ModelConfig(
        num_layers=3,
        d_model=64,
        num_heads=2,
        d_qk=16,
        d_v=32,
        ffn_mult=2,
        item_buckets=4096,
        user_feature_buckets=256,
        max_user_features=8,
        max_history_tokens=4096,
        max_candidates=64,
        attention_block=64,
    ),
    # The demo's and the mesh benchmarks': a sweep takes minutes on 2 CPU cores.
    ModelPreset.SMALL: ModelConfig(d_model=256, num_heads=2, d_qk=32, d_v=64, num_layers=3),
    ModelPreset.DEFAULT: ModelConfig(),
}
