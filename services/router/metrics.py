"""The router's Prometheus metrics, read from its own stats and views when scraped."""

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from relaygr.cluster import RankerRecord
from relaygr.metrics import LiveCollector, connectivity, counter, gauge
from relaygr.placement import Reason
from services.router.routes import Method, RankRoute
from services.router.service import RouterServicer


def register_router_metrics(
    registry: CollectorRegistry,
    servicer: RouterServicer,
    view: Callable[[], Mapping[str, RankerRecord]],
    etcd_connected: Callable[[], bool],
) -> None:
    """Expose `servicer`'s stats, the membership `view` and etcd reachability in `registry`."""

    def collect() -> Iterator[Metric]:
        yield from connectivity(etcd_connected(), len(view()))
        stats = servicer.stats
        placements: dict[tuple[str, str], float] = {
            (Method.PRE_INFER.value, reason.value): stats.placed[reason] for reason in Reason
        }
        placements.update(
            {(Method.RANK.value, route.value): stats.rank_routes[route] for route in RankRoute}
        )
        placements.update(
            {(m.value, "random"): stats.placed_random[m] for m in Method if stats.placed_random[m]}
        )
        yield counter(
            "relaygr_router_placements",
            "Requests routed, by method and why the first ranker tried was chosen (hash: the "
            "user's rendezvous owner; spilled: the owner was over the load bound; directory: "
            "the directory says where the user's cache lives; preferred: the trigger found "
            "relay room there; room: the rankers before it have no relay room; random: the "
            "placement ablation)",
            ["method", "reason"],
            placements,
        )
        yield counter(
            "relaygr_router_version_requests",
            "Requests routed, by method and the model version chosen for them (asked for, the "
            "canary's, the current one or the majority's: see docs/deploy.md, Model versions)",
            ["method", "model_version"],
            {(m.value, version): n for (m, version), n in stats.versions.items()},
        )
        yield counter(
            "relaygr_router_version_unavailable",
            "Requests refused UNAVAILABLE because no live ranker serves the model version they"
            " asked for",
            ["method"],
            {(m.value,): stats.version_unavailable[m] for m in Method},
        )
        yield counter(
            "relaygr_router_forwarded",
            "Calls to rankers by method and the ranker's status code (failed-over attempts too)",
            ["method", "code"],
            {(m.value, code.value): n for (m, code), n in stats.forwarded.items()},
        )
        yield counter(
            "relaygr_router_failovers",
            "Requests served by a ranker after an earlier one could not (fallback: a miss)",
            ["method"],
            {(m.value,): stats.failed_over[m] for m in Method},
        )
        yield counter(
            "relaygr_router_refused_then_spilled",
            "PreInfers served by a ranker after an earlier one refused them for room (a round"
            " trip the relay room view avoids)",
            [],
            {(): stats.refused_then_spilled},
        )
        yield counter(
            "relaygr_router_hedges",
            "Ranks also sent to the next ranker after rank_hedge_ms without an answer",
            ["method"],
            {(m.value,): stats.hedged[m] for m in Method},
        )
        yield counter(
            "relaygr_router_directory_writes",
            "Placements written to the etcd directory (failed: etcd unreachable)",
            ["result"],
            {
                ("written",): stats.directory_writes,
                ("failed",): stats.directory_write_failures,
            },
        )
        yield gauge(
            "relaygr_router_ranker_load",
            "PreInfers this router placed on each ranker within the relay window",
            ["instance"],
            {(instance,): load for instance, load in servicer.load.loads().items()},
        )

    registry.register(LiveCollector(collect))
