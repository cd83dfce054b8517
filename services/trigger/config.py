"""The trigger's one typed configuration (file < env RELAYGR_TRIGGER_* < flags; live overrides)."""

import enum
from dataclasses import dataclass, field

from relaygr.bounds import NON_NEGATIVE, POSITIVE, SHARE, Bound, non_negative
from relaygr.config import check_bounds, helped
from relaygr.errors import ConfigError
from relaygr.service_options import ServiceOptions, listen_field

ENV_PREFIX = "RELAYGR_TRIGGER_"


class Mode(enum.StrEnum):
    """Admission modes, for ablation: no relays, every relay, or the sequence-aware policy."""

    OFF = "off"
    ALL = "all"
    SEQUENCE_AWARE = "sequence-aware"


@dataclass(frozen=True, slots=True)
class TriggerConfig(ServiceOptions):
    listen: str = listen_field("127.0.0.1:50041")
    router_address: str = field(
        default="127.0.0.1:50051",
        metadata=helped(
            "gRPC target of the routers admitted PreInfers are sent to, spread over every"
            " replica it resolves to (ipv4:A,B or dns:///headless-service:port)"
        ),
    )
    # Admission policy: these may also be changed at run time (LIVE_FIELDS).
    mode: Mode = field(default=Mode.SEQUENCE_AWARE, metadata=helped("admission mode"))
    slo_ms: float = field(default=50.0, metadata=helped("ranking latency SLO, ms", POSITIVE))
    margin_ms: float = field(
        default=5.0,
        metadata=helped(
            "at risk when predicted full inference > slo_ms - margin_ms; below slo_ms",
            NON_NEGATIVE,
        ),
    )
    expected_gap_ms: float = field(
        default=1000.0,
        metadata=helped(
            "expected time from retrieval to the Rank, ms: a relay is admitted only where its"
            " prefill, behind the ranker's queued prefill that runs first (see no_show_prior),"
            " starts before the Rank arrives (else LOAD_LIMIT), and its PreInfer tells the"
            " ranker when the Rank is due",
            POSITIVE,
        ),
    )
    no_show_prior: float = field(
        default=1.0,
        metadata=helped(
            "share of relays assumed never ranked (filtered, abandoned) until relays end: the"
            " share the rankers report unconsumed takes over as they do. Only that share of a"
            " ranker's queued prefill delays a new relay (the rest is promoted by its own Rank"
            " first); 1, until measured, counts all of it",
            Bound(low=0, high=1),
        ),
    )
    prefill_share: float = field(
        default=0.5,
        metadata=helped(
            "deprecated, ignored: load is now checked against rankers' queued prefill"
            " (expected_gap_ms)",
            SHARE,
        ),
    )
    burst_s: float = field(
        default=2.0,
        metadata=helped(
            "deprecated, ignored: load is now checked against rankers' queued prefill"
            " (expected_gap_ms)",
            POSITIVE,
        ),
    )
    relay_budget_share: float = field(
        default=0.9,
        metadata=helped(
            "share of each ranker's relay budget (its device tier, as it reports) this trigger"
            " fills: headroom for relays other senders have in flight",
            SHARE,
        ),
    )
    relay_take_share: float = field(
        default=0.75,
        metadata=helped(
            "deprecated, ignored: the room's price now follows the at-risk relays asked for, by"
            " size (a relay is refused only where smaller ones would fill the room)",
            SHARE,
        ),
    )
    relay_spare_share: float = field(
        default=1.0,
        metadata=helped(
            "sequence-aware: a relay not at risk is still admitted while its ranker's relay room"
            " is less than this full and the prefill ahead of it starts it within half the gap,"
            " so relaying what would fit the SLO anyway only takes room and time nothing at risk"
            " needs now (1: whenever it fits)",
            Bound(low=0, high=1, meaning="0: relay only what is at risk"),
        ),
    )
    relay_window_ms: int = field(
        default=2000,
        metadata=helped(
            "how long a relay stays pinned awaiting its Rank (with relay_window_wait_factor: the"
            " longest it asks for)",
            POSITIVE,
        ),
    )
    relay_window_wait_factor: float = field(
        default=0.0,
        metadata=helped(
            "a relay asks for this many times its ranker's reported 99th-percentile wait of a"
            " relay for its Rank (Describe: relay_wait_p99_ms), at most relay_window_ms, so"
            " no-shows hold room no longer than the gap's tail needs; relay_window_ms while the"
            " ranker has reported none",
            non_negative("0: every relay asks for relay_window_ms"),
        ),
    )
    refusal_cooldown_ms: int = field(
        default=1000,
        metadata=helped(
            "a ranker that refused a relay gets none until it reports room again, or this long",
            POSITIVE,
        ),
    )
    # Dispatch and observation.
    dispatch_queue: int = field(
        default=256, metadata=helped("admitted PreInfers waiting to send", POSITIVE)
    )
    dispatch_concurrency: int = field(
        default=8, metadata=helped("PreInfers in flight at once", POSITIVE)
    )
    observe_interval_ms: int = field(
        default=1000,
        metadata=helped(
            "how often rankers' relay room and queued prefill are read (Describe)", POSITIVE
        ),
    )
    # Input limits, enforced before anything else.
    max_long_term: int = field(
        default=65536, metadata=helped("most long-term behaviours", POSITIVE)
    )
    max_short_term: int = field(
        default=65536, metadata=helped("most expected short-term", POSITIVE)
    )
    max_candidates: int = field(
        default=65536, metadata=helped("most expected candidates", POSITIVE)
    )
    max_user_features: int = field(
        default=1024, metadata=helped("most user feature tokens", POSITIVE)
    )

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", Mode(self.mode))  # a plain string from Python code
        except ValueError as err:
            raise ConfigError(f"trigger mode must be one of {[m.value for m in Mode]}") from err
        check_bounds(self, "trigger")
        if self.margin_ms >= self.slo_ms:
            raise ConfigError(f"trigger margin_ms must be in [0, slo_ms), got {self.margin_ms}")
        self.check_service("trigger")  # last: a field's own error is named first

    @property
    def relay_window_s(self) -> float:
        return self.relay_window_ms / 1e3


# What the live config key (`{etcd_prefix}/config/trigger`, a JSON object) may change.
LIVE_FIELDS = (
    "mode", "slo_ms", "margin_ms", "expected_gap_ms", "no_show_prior", "prefill_share", "burst_s",
    "relay_budget_share", "relay_take_share", "relay_spare_share", "relay_window_ms",
    "relay_window_wait_factor", "refusal_cooldown_ms",
)  # fmt: skip
