"""The ranker's Prometheus metrics: latency observed per request; tiers, drops, relays and queues
read from the engine's own stats and state when scraped."""

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from relaygr.metrics import LiveCollector, connectivity, counter, gauge, histogram
from services.ranker.engine import CacheOutcome, PreInferOutcome
from services.ranker.handoff import HandoffStats
from services.ranker.kv_store import Drop, Tier
from services.ranker.outcomes import FetchResult
from services.ranker.transfer import Refusal
from services.ranker.warm import Warming

# Server-side time of one request: sub-millisecond HBM hits up to multi-second full inference.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
)  # fmt: skip
# One peer fetch: a NOT_FOUND round trip (sub-millisecond) up to a timed-out transfer.
FETCH_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
# Which cache outcomes count as a hit in which tier, for the hit ratio.
HIT_TIERS = {
    Tier.HBM: (CacheOutcome.HBM_HIT, CacheOutcome.WAITED_INFLIGHT),
    Tier.DRAM: (CacheOutcome.DRAM_HIT,),
}


class RankerMetrics:
    """Every metric of one ranker, in its own registry.

    Latency histograms are observed by the servicer (`observe_rank`, `observe_pre_infer`);
    every series of theirs exists from the start, at zero. Everything else is read at scrape
    time from the warm ranker (`warming`: the engine, hand-off stats and etcd connectivity;
    nothing while it warms up), so nothing is counted twice.
    """

    def __init__(self, registry: CollectorRegistry, warming: Warming) -> None:
        self._warming = warming
        self.rank_latency = Histogram(
            "relaygr_ranker_rank_latency_seconds",
            "Server-side time of a Rank, by cache outcome",
            ["cache_outcome"],
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.pre_infer_latency = Histogram(
            "relaygr_ranker_pre_infer_latency_seconds",
            "Server-side time of a PreInfer, by outcome",
            ["outcome"],
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self._rank = {o: self.rank_latency.labels(o.value) for o in CacheOutcome}
        self._pre_infer = {o: self.pre_infer_latency.labels(o.value) for o in PreInferOutcome}
        self._init_fetch_metrics(registry)
        registry.register(LiveCollector(self._collect))

    # -- peer fetch ------------------------------------------------------------------------

    def _init_fetch_metrics(self, registry: CollectorRegistry) -> None:
        self.fetch_latency = Histogram(
            "relaygr_ranker_fetch_seconds",
            "Time of one peer fetch this ranker made, by result (hit: a checked entry landed;"
            " not_found, timeout, refused, error: the prefix was then computed); the Ranks and"
            " PreInfers served from fetched prefixes are the peer_fetched outcome of their"
            " latency histograms",
            ["result"],
            registry=registry,
            buckets=FETCH_BUCKETS_S,
        )
        self._fetch = {r: self.fetch_latency.labels(r.value) for r in FetchResult}
        self.fetches_served = Counter(
            "relaygr_ranker_fetches_served",
            "Prefixes this ranker sent to peers that fetched them",
            registry=registry,
        )
        self.fetch_served_bytes = Counter(
            "relaygr_ranker_fetch_served_bytes",
            "Payload bytes of the prefixes this ranker sent to peers that fetched them",
            registry=registry,
        )

    def observe_fetch(self, result: FetchResult, seconds: float) -> None:
        """One peer fetch this ranker made (the engine's `PeerFetch` timings sink)."""
        self._fetch[result].observe(seconds)

    def observe_fetch_served(self, nbytes: int) -> None:
        """One prefix sent to a peer that fetched it."""
        self.fetches_served.inc()
        self.fetch_served_bytes.inc(nbytes)

    def observe_rank(self, outcome: CacheOutcome, seconds: float) -> None:
        self._rank[outcome].observe(seconds)

    def observe_pre_infer(self, outcome: PreInferOutcome, seconds: float) -> None:
        self._pre_infer[outcome].observe(seconds)

    def ranks_by_outcome(self) -> dict[str, float]:
        """Ranks served so far per cache outcome (the latency histogram's counts)."""
        counts: dict[str, float] = {}
        for family in self.rank_latency.collect():
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    counts[sample.labels["cache_outcome"]] = sample.value
        return counts

    def _collect(self) -> Iterator[Metric]:
        warm = self._warming.warm
        if warm is None:
            return  # warming up: nothing to report beyond the (empty) histograms
        connected = None if warm.etcd_connected is None else warm.etcd_connected()
        yield from connectivity(connected, None)
        yield from _handoff_metrics(warm.handoff.stats)
        engine = warm.engine
        ranks = self.ranks_by_outcome()
        total = sum(ranks.values())
        yield gauge(
            "relaygr_ranker_cache_hit_ratio",
            "Share of Ranks since start served from a cached prefix in the tier (HBM: resident "
            "or waited for in flight; DRAM: reloaded); absent before the first Rank",
            ["tier"],
            {
                (tier.value,): sum(ranks.get(o.value, 0.0) for o in outcomes) / total
                for tier, outcomes in HIT_TIERS.items()
                if total
            },
        )
        core = engine.stats()  # as of the last event: the ranker's tick expires relays
        usage = core.tiers
        yield gauge(
            "relaygr_ranker_kv_used_bytes",
            "Bytes of prefix KV caches held in the tier",
            ["tier"],
            {(t.value,): u.used_bytes for t, u in usage.items()},
        )
        yield gauge(
            "relaygr_ranker_kv_pinned_bytes",
            "Bytes pinned in the tier by relays awaiting their Rank",
            ["tier"],
            {(t.value,): u.pinned_bytes for t, u in usage.items()},
        )
        yield gauge(
            "relaygr_ranker_kv_budget_bytes",
            "Byte budget of the tier",
            ["tier"],
            {(t.value,): u.budget_bytes for t, u in usage.items()},
        )
        yield gauge(
            "relaygr_ranker_kv_entries",
            "Prefix caches held in the tier",
            ["tier"],
            {(t.value,): u.entries for t, u in usage.items()},
        )
        stats = core.kv
        yield counter(
            "relaygr_ranker_kv_drops",
            "Prefix caches that left a tier, by reason (demoted: evicted from HBM with a DRAM "
            "copy kept; evicted: no copy kept; expired: past the DRAM time to live; superseded: "
            "the user's prefix changed; too_large: does not fit the tier at all)",
            ["tier", "reason"],
            {(t.value, r.value): stats.dropped[t, r] for t in Tier for r in Drop},
        )
        yield counter(
            "relaygr_ranker_kv_stored",
            "Prefix caches stored into the tier",
            ["tier"],
            {(t.value,): stats.stored[t] for t in Tier},
        )
        yield counter(
            "relaygr_ranker_kv_rejected",
            "Prefixes the device tier could not hold beside pinned relays",
            [],
            {(): stats.hbm_rejected},
        )
        yield counter(
            "relaygr_ranker_relays_consumed",
            "Relays (pinned pre-inferred prefixes) consumed by their Rank",
            [],
            {(): stats.relays_consumed},
        )
        yield counter(
            "relaygr_ranker_relays_unconsumed",
            "Relays produced but never consumed: the relay window ended (expired) or the cache "
            "was dropped while pinned (dropped)",
            ["reason"],
            {
                ("expired",): stats.relays_expired_unconsumed,
                ("dropped",): stats.relays_dropped_unconsumed,
            },
        )
        tail_ms = core.relay_wait_p99_ms
        yield gauge(
            "relaygr_ranker_relay_wait_p99_seconds",
            "99th percentile of how long the latest relays (up to 1,024) waited from their pin "
            "to their Rank's arrival: the relay window to cover; absent below 20 timed",
            [],
            {(): tail_ms / 1e3} if tail_ms > 0 else {},
        )
        yield gauge(
            "relaygr_ranker_queue_depth",
            "Compute jobs waiting for the worker, by priority",
            ["priority"],
            {(p.name.lower(),): n for p, n in core.queue_depth.items()},
        )
        yield histogram(
            "relaygr_ranker_batch_requests",
            "Ranks per scoring model call (a cached Rank's scoring or a full inference; 1: run"
            " alone), counted as the call starts",
            core.batch_requests,
        )
        yield histogram(
            "relaygr_ranker_batch_rows",
            "Rows per scoring model call: short-term behaviours + candidates of its Ranks (a"
            " full inference: its whole history + candidates), summed",
            core.batch_rows,
        )
        yield histogram(
            "relaygr_ranker_chunk_batch_requests",
            "Users per background prefill chunk call (1: one user's chunk alone), counted as the"
            " call starts",
            core.chunk_batch_requests,
        )
        yield histogram(
            "relaygr_ranker_chunk_batch_rows",
            "New prefix tokens per background prefill chunk call, summed over its users",
            core.chunk_batch_rows,
        )
        cost = core.cost_model
        yield gauge(
            "relaygr_ranker_cost_model_error",
            "Median |predicted - measured| / measured compute time of the cost model in use, over"
            " the timed runs it was fitted to (calibration, then served work; 0: not fitted here)",
            [],
            {(): cost.median_abs_rel_error},
        )
        yield gauge(
            "relaygr_ranker_cost_model_samples",
            "Timed runs the cost model in use was fitted to",
            [],
            {(): cost.samples},
        )
        yield gauge(
            "relaygr_ranker_queued_prefill_seconds",
            "Predicted compute time of the background prefill queued or running (the cost "
            "model's), which a PreInfer admitted now would wait behind if its Rank is due later",
            [],
            {(): core.queued_background_ms / 1e3},
        )
        if engine.peer_fetch is not None:
            yield counter(
                "relaygr_ranker_fetched_bytes",
                "Payload bytes of the prefixes fetched from peers that landed here",
                [],
                {(): engine.peer_fetch.stats.bytes_fetched},
            )
            transfer = engine.peer_fetch.transfer
            yield gauge(
                "relaygr_ranker_transfer_cost_ms",
                "The peer-transfer cost model in use: fixed ms and ms per MiB (the configured "
                "prior, refitted from the fetches made)",
                ["term"],
                {("fixed",): transfer.fixed_ms, ("per_mb",): transfer.ms_per_mb},
            )
        yield gauge(
            "relaygr_ranker_inflight_prefixes",
            "Prefix computations and reloads in flight",
            [],
            {(): core.inflight},
        )


def _handoff_metrics(stats: HandoffStats) -> Iterator[Metric]:
    yield counter(
        "relaygr_ranker_handoff_sent_entries",
        "Prefix caches this ranker handed to its successors while draining",
        [],
        {(): stats.sent_entries},
    )
    yield counter(
        "relaygr_ranker_handoff_sent_bytes",
        "Payload bytes of the prefix caches handed off while draining",
        [],
        {(): stats.sent_bytes},
    )
    yield counter(
        "relaygr_ranker_handoff_unsent_entries",
        "Prefix caches a drain planned to hand off but did not: past the time budget, no "
        "successor, or their target's stream failed",
        [],
        {(): stats.unsent_entries},
    )
    yield counter(
        "relaygr_ranker_handoff_failed_streams",
        "Hand-off streams to a successor that ended in an error",
        [],
        {(): stats.failed_streams},
    )
    yield counter(
        "relaygr_ranker_handoff_send_seconds",
        "Wall time spent handing off prefix caches while draining",
        [],
        {(): stats.send_seconds},
    )
    yield counter(
        "relaygr_ranker_handoff_received_streams",
        "Hand-off streams received from draining peers (refused: whole streams refused, this "
        "ranker draining or receiving handoff_max_streams already)",
        ["result"],
        {("taken",): stats.received_streams, ("refused",): stats.refused_streams},
    )
    yield counter(
        "relaygr_ranker_handoff_received_from_streams",
        "Hand-off streams taken, by the sending ranker (the instance its certificate names"
        " under mutual TLS)",
        ["sender"],
        {(sender,): n for sender, n in stats.received_from.items()},
    )
    yield counter(
        "relaygr_ranker_handoff_admitted_entries",
        "Handed-off prefix caches admitted, unpinned, by tier",
        ["tier"],
        {(t.value,): stats.admitted[t] for t in Tier},
    )
    yield counter(
        "relaygr_ranker_handoff_admitted_bytes",
        "Bytes of handed-off prefix caches admitted, by tier",
        ["tier"],
        {(t.value,): stats.admitted_bytes[t] for t in Tier},
    )
    yield counter(
        "relaygr_ranker_handoff_refused_entries",
        "Handed-off prefix caches refused, by reason (never served)",
        ["reason"],
        {(r.value,): stats.refused[r] for r in Refusal},
    )
    yield counter(
        "relaygr_ranker_handoff_refused_bytes",
        "Bytes of handed-off prefix caches refused, by reason",
        ["reason"],
        {(r.value,): stats.refused_bytes[r] for r in Refusal},
    )
    yield counter(
        "relaygr_ranker_handoff_receive_seconds",
        "Wall time spent receiving hand-off streams, summed over streams",
        [],
        {(): stats.receive_seconds},
    )
