"""The trigger's Prometheus metrics, read from its own counters and views when scraped."""

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from relaygr.cluster import RankerRecord
from relaygr.metrics import LiveCollector, connectivity, counter, gauge
from services.trigger.dispatch import Dispatcher
from services.trigger.policy import Reason
from services.trigger.service import TriggerServicer

# dispatch outcome label -> the servicer's counter (or the dispatcher's, for "cancelled")
_DISPATCH_OUTCOMES = {
    "relayed": "relayed",
    "refused": "refused",
    "failed": "dispatch_failed",
    "dropped": "dispatch_dropped",
}
_FAILED = "failed_"


def register_trigger_metrics(
    registry: CollectorRegistry,
    servicer: TriggerServicer,
    dispatcher: Dispatcher,
    view: Callable[[], Mapping[str, RankerRecord]],
    etcd_connected: Callable[[], bool],
) -> None:
    """Expose the servicer's and dispatcher's counters, the membership `view` and etcd
    reachability in `registry`."""

    def collect() -> Iterator[Metric]:
        yield from connectivity(etcd_connected(), len(view()))
        counts = servicer.counters
        yield counter(
            "relaygr_trigger_admissions",
            "Retrieval events decided, by admission reason (admitted: relayed)",
            ["reason"],
            {(reason.value,): counts[reason] for reason in Reason},
        )
        outcomes = {(label,): counts[key] for label, key in _DISPATCH_OUTCOMES.items()}
        outcomes["cancelled",] = dispatcher.counters["cancelled"]
        yield counter(
            "relaygr_trigger_dispatches",
            "Admitted PreInfers by outcome (relayed: resident on a ranker; refused: no room; "
            "failed: any other error; dropped: the dispatch queue was full, answered "
            "load_limit; cancelled: still queued at shutdown)",
            ["outcome"],
            outcomes,
        )
        yield counter(
            "relaygr_trigger_dispatch_failures",
            "PreInfers the router answered with an error, by status code",
            ["code"],
            {
                (key.removeprefix(_FAILED),): value
                for key, value in dispatcher.counters.items()
                if key.startswith(_FAILED)
            },
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
