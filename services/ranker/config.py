"""The ranker's one typed configuration (file < env RELAYGR_RANKER_* < flags)."""

from dataclasses import dataclass, field
from pathlib import Path

from relaygr.bounds import POSITIVE, SHARE, non_negative
from relaygr.config import check_bounds, helped
from relaygr.cost import TransferCost
from relaygr.device import parse_device_kind
from relaygr.errors import ConfigError
from relaygr.service_options import ServiceOptions, health_linger_field, listen_field
from services.ranker.core_types import CoreSettings
from services.ranker.model_config import ModelPreset
from services.ranker.peers import PreviousOwners

ENV_PREFIX = "RELAYGR_RANKER_"
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class RankerConfig(ServiceOptions):
    listen: str = listen_field("127.0.0.1:50061")
    # Routers follow a ranker's membership, not its health: its drain leaves the membership
    # while it still serves, and a router sends a Rank the ranker's stop cancelled to the next.
    health_linger_s: float = health_linger_field(0.0)
    instance_id: str = field(default="", metadata=helped("instance id (default: host:port)"))
    device: str = field(default="auto", metadata=helped("auto, cpu, cuda or npu"))
    checkpoint: Path | None = field(
        default=None, metadata=helped("checkpoint directory (config.json + weights.pt)")
    )
    model: ModelPreset = field(
        default=ModelPreset.DEFAULT,
        metadata=helped(
            "shape of the seeded random model (no checkpoint): tiny (the tests'), small (the"
            " demo's and benchmarks'), default (services/ranker/model_config.py PRESETS)"
        ),
    )
    model_config: Path | None = field(
        default=None,
        metadata=helped("JSON of ModelConfig fields that override the --model preset's"),
    )
    model_seed: int = field(default=0, metadata=helped("seed of the random model"))
    hbm_budget_mb: float = field(
        default=2048.0, metadata=helped("device KV tier budget, MiB", POSITIVE)
    )
    dram_budget_mb: float = field(
        default=8192.0, metadata=helped("host KV tier budget, MiB", non_negative("0: no host tier"))
    )
    dram_ttl_s: float = field(
        default=300.0, metadata=helped("host tier time to live, seconds", POSITIVE)
    )
    relay_window_ms: int = field(
        default=2000,
        metadata=helped(
            "default pin of a pre-inferred prefix awaiting its Rank; at most max_relay_window_ms",
            POSITIVE,
        ),
    )
    max_relay_window_ms: int = field(
        default=60000,
        metadata=helped("longest pin a PreInfer may ask for (longer: refused)", POSITIVE),
    )
    prefill_chunk_tokens: int = field(
        default=512, metadata=helped("background prefill chunk: a Rank waits at most one", POSITIVE)
    )
    prefill_chunk_fixed_share: float = field(
        default=0.25,
        metadata=helped(
            "most share of a background chunk's predicted time that its call's fixed cost may"
            " take: the chunk grows past prefill_chunk_tokens, in steps of it, up to"
            " max_batch_rows, until it does (from the cost model in use: on an accelerator,"
            " whose call costs a thousand tokens' time, small chunks would make a relayed"
            " prefill cost several times its compute); 1: never grows",
            SHARE,
        ),
    )
    relay_enabled: bool = field(
        default=True, metadata=helped("serve Ranks from prefix caches (off: full inference)")
    )
    max_queued_ranks: int = field(
        default=64, metadata=helped("rank jobs queued before shedding", POSITIVE)
    )
    max_queued_prefills: int = field(
        default=256,
        metadata=helped("background jobs queued before refusing pre-inference", POSITIVE),
    )
    max_batch_requests: int = field(
        default=8,
        metadata=helped(
            "most Ranks scored in one model call (or users' background prefill chunks in one"
            " call): those queued together when the worker frees (none is held back to wait"
            " for a batch); 1: every Rank and every chunk its own call",
            POSITIVE,
        ),
    )
    max_batch_rows: int = field(
        default=4096,
        metadata=helped(
            "most rows (short-term behaviours + candidates, summed over its Ranks; a full"
            " inference's whole history; a prefill chunk's tokens) in one batched model call; a"
            " Rank with more runs alone",
            POSITIVE,
        ),
    )
    batch_backlog: int = field(
        default=4,
        metadata=helped(
            "Ranks queued (the next one included; for prefill chunks, background jobs queued)"
            " from which a call batches although sharing saves a joiner less than half its own"
            " call (a shared call ends every Rank in it last; only a backlog repays that); where"
            " the cost model's batch saving is at least half a call, Ranks batch at any load; 1:"
            " batch whatever is queued",
            POSITIVE,
        ),
    )
    max_chunk_batch_rows: int = field(
        default=512,
        metadata=helped(
            "most new tokens of several users' background prefill chunks in one call (and"
            " within max_batch_rows): a Rank arriving meanwhile waits for the whole call, so"
            " keep it near prefill_chunk_tokens; short last chunks of several prefixes batch",
            POSITIVE,
        ),
    )
    calibration_lengths: tuple[int, ...] = field(
        # The quadratic (attention) term only shows at long lengths: a fit that stops at 2k
        # predicts an 8k history at half its real cost, and the trigger then misjudges risk.
        # Spread over the range so that no one length decides a coefficient.
        default=(256, 512, 1024, 2048, 4096, 8192),
        metadata=helped(
            "history lengths timed at start-up, each > 0 (clamped to the model's limit); span"
            " the lengths you serve"
        ),
    )
    calibration_candidates: int = field(
        default=64, metadata=helped("candidates when calibrating", POSITIVE)
    )
    calibration_repeats: int = field(
        default=3,
        metadata=helped("timed runs per calibration length (the median is fitted)", POSITIVE),
    )
    calibration_lock_dir: Path | None = field(
        default=None,
        metadata=helped(
            "directory of the host-wide calibration lock: rankers sharing it calibrate one at a"
            " time (default: the temporary directory)"
        ),
    )
    cost_refit_interval_s: float = field(
        default=5.0,
        metadata=helped(
            "how often the cost model is refitted to the compute timings served, seconds",
            POSITIVE,
        ),
    )
    cost_republish_interval_s: float = field(
        default=30.0,
        metadata=helped(
            "least time between republications of a changed cost model to the mesh, seconds",
            POSITIVE,
        ),
    )
    threads: int = field(
        default=0,
        metadata=helped(
            "torch intra-op compute threads; auto: the process's CPU quota (the least of"
            " cgroup cpu.max or cfs quota and the CPU affinity, at least 1)",
            non_negative("0: auto"),
        ),
    )
    # Fewer than the other services' default: each Rank holds tensors while it waits.
    max_concurrent_rpcs: int = field(
        default=1024,
        metadata=helped("RPCs in progress at once; more get RESOURCE_EXHAUSTED", POSITIVE),
    )
    etcd_endpoints: tuple[str, ...] = field(
        default=(), metadata=helped("etcd endpoints to register in (none: standalone)")
    )
    lease_ttl_s: float = field(
        default=5.0,
        metadata=helped("membership lease, seconds: a dead ranker leaves within this", POSITIVE),
    )
    advertise_address: str = field(
        default="", metadata=helped("host:port routers dial (default: 127.0.0.1:<bound port>)")
    )

    # Peer fetch (docs/reliability.md): a miss fetches the prefix from a peer that may hold it.
    peer_fetch: bool = field(
        default=True,
        metadata=helped(
            "on a miss, fetch the prefix from the peer that held it (the user's previous owner,"
            " or its directory entry) when the transfer is predicted sooner than recomputing"
        ),
    )
    peer_fetch_window_s: float = field(
        default=300.0,
        metadata=helped(
            "ask a user's previous owner only this long after a ranker joined or left (this"
            " one's start included): a settled fleet's cold misses pay no fetch round trip",
            POSITIVE,
        ),
    )
    peer_fetch_cold_asks: int = field(
        default=16,
        metadata=helped(
            "stop asking previous owners once this many asks since the last membership change"
            " all found nothing (a fleet that started together holds nothing to fetch)",
            POSITIVE,
        ),
    )
    transfer_fixed_ms: float = field(
        default=2.0,
        metadata=helped(
            "prior of a peer fetch's fixed cost, ms (refitted from the fetches made once the"
            " compute cost is calibrated here)",
            non_negative("0: free"),
        ),
    )
    transfer_ms_per_mb: float = field(
        default=1.0,
        metadata=helped("prior of a peer fetch's cost per MiB, ms", non_negative("0: free")),
    )
    fetch_timeout_ms: int = field(
        default=250,
        metadata=helped(
            "most time one peer fetch may take (else twice its predicted time +"
            " fetch_timeout_floor_ms, within the request's deadline); then the prefix is computed",
            POSITIVE,
        ),
    )
    fetch_timeout_floor_ms: int = field(
        default=20,
        metadata=helped(
            "time a peer fetch gets beyond twice its predicted time: the round trip, a first"
            " connection's set-up and a loaded host's scheduling, which the transfer cost does"
            " not price",
            POSITIVE,
        ),
    )
    # Hand-off on drain (docs/reliability.md): a draining ranker sends its prefixes onward.
    handoff: bool = field(
        default=True,
        metadata=helped(
            "on drain (SIGTERM, scale-down, rolling restart), stream the most valuable held"
            " prefixes to the rankers that own their users next"
        ),
    )
    handoff_budget_s: float = field(
        default=5.0,
        metadata=helped(
            "time the drain's hand-off may take, seconds, at most drain_grace_s (it runs inside"
            " the drain, before the server's stop); what does not fit is not sent",
            POSITIVE,
        ),
    )
    handoff_bandwidth_mb_s: float = field(
        default=256.0,
        metadata=helped("MiB per second a hand-off may send, all peers together", POSITIVE),
    )
    handoff_max_entries: int = field(
        default=100_000,
        metadata=helped("most prefixes one hand-off sends (the most valuable first)", POSITIVE),
    )
    handoff_max_streams: int = field(
        default=4,
        metadata=helped(
            "hand-off streams received at once; more get RESOURCE_EXHAUSTED (each buffers at"
            " most one prefix)",
            POSITIVE,
        ),
    )

    def __post_init__(self) -> None:
        parse_device_kind(self.device)
        try:
            object.__setattr__(self, "model", ModelPreset(self.model))  # a string from Python
        except ValueError as err:
            raise ConfigError(
                f"ranker model must be one of {[p.value for p in ModelPreset]}, got {self.model!r}"
            ) from err
        if self.checkpoint is not None and self.model_config is not None:
            raise ConfigError("set either checkpoint or model_config, not both")
        if self.checkpoint is not None and self.model is not ModelPreset.DEFAULT:
            raise ConfigError("set either checkpoint or model, not both: a checkpoint has its own")
        check_bounds(self, "ranker")
        if self.relay_window_ms > self.max_relay_window_ms:
            raise ConfigError("ranker relay_window_ms must be <= max_relay_window_ms")
        if not self.calibration_lengths or min(self.calibration_lengths) <= 0:
            raise ConfigError("ranker calibration_lengths must be positive token counts")
        # Last, so a field's own error is named first; no etcd endpoints: standalone.
        self.check_service("ranker", etcd_required=False)

    def core_settings(self) -> CoreSettings:
        """The ranker core's settings (services/ranker/core.py), for every driver of it."""
        return CoreSettings(
            relay_enabled=self.relay_enabled,
            relay_window_s=self.relay_window_ms / 1e3,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            prefill_chunk_fixed_share=self.prefill_chunk_fixed_share,
            max_relay_window_s=self.max_relay_window_ms / 1e3,
            max_queued_ranks=self.max_queued_ranks,
            max_queued_prefills=self.max_queued_prefills,
            max_batch_requests=self.max_batch_requests,
            max_batch_rows=self.max_batch_rows,
            batch_backlog=self.batch_backlog,
            max_chunk_batch_rows=self.max_chunk_batch_rows,
        )

    def transfer_prior(self) -> TransferCost:
        """The peer-transfer cost assumed until fetches are timed (the server's and the
        simulator's)."""
        return TransferCost(self.transfer_fixed_ms, self.transfer_ms_per_mb)

    def previous_owners(self) -> PreviousOwners:
        """When this ranker's misses ask users' previous owners (the server's and the
        simulator's, one per ranker)."""
        return PreviousOwners(self.peer_fetch_window_s, self.peer_fetch_cold_asks)

    @property
    def hbm_budget_bytes(self) -> int:
        return int(self.hbm_budget_mb * MIB)

    @property
    def dram_budget_bytes(self) -> int:
        return int(self.dram_budget_mb * MIB)

    @property
    def handoff_bytes_per_s(self) -> float:
        return self.handoff_bandwidth_mb_s * MIB
