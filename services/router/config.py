"""The router's one typed configuration (file < env RELAYGR_ROUTER_* < flags)."""

import enum
from dataclasses import dataclass, field

from relaygr.bounds import POSITIVE, non_negative
from relaygr.config import check_bounds, helped
from relaygr.errors import ConfigError
from relaygr.service_options import ServiceOptions, listen_field
from services.router.forward import ForwardSettings

ENV_PREFIX = "RELAYGR_ROUTER_"


class PlacementMode(enum.StrEnum):
    """`affinity`: the relay design. `random`: any live ranker, PreInfer and Rank drawn
    independently (an ablation that shows what affinity buys; never for production)."""

    AFFINITY = "affinity"
    RANDOM = "random"


@dataclass(frozen=True, slots=True)
class RouterConfig(ServiceOptions):
    listen: str = listen_field("127.0.0.1:50051")
    load_epsilon: float = field(
        default=0.25,
        metadata=helped("a ranker over (1+eps) x mean load passes users on", POSITIVE),
    )
    load_floor: float = field(
        default=16.0,
        metadata=helped("mean relays per window below which nobody spills", POSITIVE),
    )
    relay_window_ms: int = field(
        default=2000,
        metadata=helped("how long a spilled placement is kept in the directory", POSITIVE),
    )
    rank_hedge_ms: int = field(
        default=0,
        metadata=helped(
            "a Rank unanswered this long is also sent to the next ranker in its order; the"
            " first reply wins. Set it well above the Rank P99: each hedge computes the Rank"
            " twice",
            non_negative("0: never"),
        ),
    )
    observe_interval_ms: int = field(
        default=1000,
        metadata=helped(
            "how often rankers' relay room is read (Describe), so PreInfers skip full rankers",
            non_negative("0: never; only refusals are learnt from"),
        ),
    )
    refusal_cooldown_ms: int = field(
        default=1000,
        metadata=helped(
            "a ranker that refused a PreInfer for room is tried last until it reports room"
            " again, or this long",
            POSITIVE,
        ),
    )
    placement: PlacementMode = field(
        default=PlacementMode.AFFINITY, metadata=helped("affinity, or random for ablation")
    )
    # Checked on the packed arrays' bytes before forwarding; rankers enforce their model's limits.
    max_tokens: int = field(
        default=65536,
        metadata=helped("most history tokens (user features + behaviours)", POSITIVE),
    )
    max_candidates: int = field(
        default=65536, metadata=helped("most candidates in a Rank", POSITIVE)
    )

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "placement", PlacementMode(self.placement))
        except ValueError as err:
            raise ConfigError(f"router placement must be one of {list(PlacementMode)}") from err
        check_bounds(self, "router")
        self.check_service("router")  # last: a field's own error is named first

    def forward_settings(self) -> ForwardSettings:
        """The forwarder's settings: windows and delays in seconds, a hedge delay of 0 as None."""
        return ForwardSettings(
            load_epsilon=self.load_epsilon,
            load_floor=self.load_floor,
            relay_window_s=self.relay_window_ms / 1e3,
            rank_hedge_s=self.rank_hedge_ms / 1e3 or None,
            random_placement=self.placement is PlacementMode.RANDOM,
            refusal_s=self.refusal_cooldown_ms / 1e3,
        )
