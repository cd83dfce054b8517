"""The trigger's Prometheus metrics, read from its own stats and views when scraped."""

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from relaygr.cluster import RankerRecord
from relaygr.metrics import LiveCollector, connectivity, counter, gauge
from services.trigger.dispatch import Dispatcher
from services.trigger.policy import Reason
from services.trigger.service import TriggerServicer


def register_trigger_metrics(
    registry: CollectorRegistry,
    servicer: TriggerServicer,
    dispatcher: Dispatcher,
    view: Callable[[], Mapping[str, RankerRecord]],
    etcd_connected: Callable[[], bool],
) -> None:
    """Expose the servicer's and dispatcher's stats, the membership `view` and etcd
    reachability in `registry`."""

    def collect() -> Iterator[Metric]:
        yield from connectivity(etcd_connected(), len(view()))
        stats = servicer.stats
        yield counter(
            "relaygr_trigger_admissions",
            "Retrieval events decided, by admission reason (admitted: relayed)",
            ["reason"],
            {(reason.value,): stats.decisions[reason] for reason in Reason},
        )
        yield counter(
            "relaygr_trigger_version_decisions",
            "Retrieval events decided, by the model version chosen for the user",
            ["model_version"],
            {(version,): n for version, n in stats.versions.items()},
        )
        outcomes = {
            ("relayed",): stats.relayed,
            ("refused",): stats.refused,
            ("failed",): stats.dispatch_failed,
            ("dropped",): stats.dispatch_dropped,
            ("cancelled",): dispatcher.stats.cancelled,
        }
        yield counter(
            "relaygr_trigger_dispatches",
            "Admitted PreInfers by outcome (relayed: resident on a ranker; refused: no room; "
            "failed: any other error; dropped: the dispatch queue was full, answered "
            "load_limit; cancelled: still queued at shutdown)",
            ["outcome"],
            outcomes,
        )
        yield counter(
            "relaygr_trigger_relays_landed_elsewhere",
            "Relays the router placed on another ranker than the one the trigger found room on",
            [],
            {(): stats.landed_elsewhere},
        )
        yield counter(
            "relaygr_trigger_dispatch_failures",
            "PreInfers the router answered with an error, by status code",
            ["code"],
            {(code.name,): n for code, n in dispatcher.stats.failed.items()},
        )
        yield gauge(
            "relaygr_trigger_slo_seconds",
            "The ranking latency SLO in force (slo_ms of the live config), which admission"
            " judges risk against and the ranking P99 alert compares with",
            [],
            {(): servicer.policy.cfg.slo_ms / 1e3},
        )
        yield gauge(
            "relaygr_trigger_no_show_share",
            "The share of relays no Rank consumed, as the rankers' relay ends show it (blended"
            " with no_show_prior until relays end): only this share of a ranker's queued"
            " prefill counts against a new relay (load_limit)",
            [],
            {(): servicer.policy.no_show_share()},
        )
        yield gauge(
            "relaygr_trigger_dispatch_queue_depth",
            "Admitted PreInfers waiting to be sent",
            [],
            {(): dispatcher.queued()},
        )
        yield gauge(
            "relaygr_trigger_dispatch_in_flight",
            "Admitted PreInfers being sent",
            [],
            {(): dispatcher.in_flight()},
        )

    registry.register(LiveCollector(collect))
