"""The router's one typed configuration (file < env RELAYGR_ROUTER_* < flags)."""

import enum
from dataclasses import dataclass, field

from relaygr.config import require_positive
from relaygr.errors import ConfigError

ENV_PREFIX = "RELAYGR_ROUTER_"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


class PlacementMode(enum.StrEnum):
    """`affinity`: the relay design. `random`: any live ranker, PreInfer and Rank drawn
    independently (an ablation that shows what affinity buys; never for production)."""

    AFFINITY = "affinity"
    RANDOM = "random"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    listen: str = field(default="127.0.0.1:50051", metadata=_help("gRPC listen address"))
    etcd_endpoints: tuple[str, ...] = field(
        default=("127.0.0.1:2379",), metadata=_help("etcd endpoints, host:port[,...]")
    )
    etcd_prefix: str = field(default="/relaygr", metadata=_help("etcd key prefix of the mesh"))
    load_epsilon: float = field(
        default=0.25, metadata=_help("a ranker over (1+eps) x mean load passes users on")
    )
    load_floor: float = field(
        default=16.0, metadata=_help("mean relays per window below which nobody spills")
    )
    relay_window_ms: int = field(
        default=2000, metadata=_help("how long a spilled placement is kept in the directory")
    )
    placement: PlacementMode = field(
        default=PlacementMode.AFFINITY, metadata=_help("affinity, or random for ablation")
    )
    max_message_mb: int = field(default=16, metadata=_help("largest gRPC message, MiB"))
    drain_grace_s: float = field(default=10.0, metadata=_help("time to finish work on SIGTERM"))

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "placement", PlacementMode(self.placement))
        except ValueError as err:
            raise ConfigError(f"router placement must be one of {list(PlacementMode)}") from err
        require_positive(
            self,
            ("load_epsilon", "load_floor", "relay_window_ms", "max_message_mb", "drain_grace_s"),
            "router",
        )
        if not self.etcd_endpoints:
            raise ConfigError("router etcd_endpoints must name at least one host:port")
