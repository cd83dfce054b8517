"""Writes helm/relaygr/files/dashboard.json, RelayGR's Grafana dashboard, with the Grafana
Foundation SDK (a dev dependency): the chart ships it in a ConfigMap that Grafana's dashboard
sidecar picks up (metrics.grafanaDashboard.enabled). Run this after changing a panel; `--check`
(tests/helm/test_dashboard.py) fails when the committed file is stale.

    python tools/dashboard.py [--check]
"""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders.common import StackingConfig
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef

FILES = Path(__file__).resolve().parent.parent / "helm" / "relaygr" / "files"
DASHBOARD_PATH = FILES / "dashboard.json"
UID = "relaygr-overview"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RANK = "relaygr_ranker_rank_latency_seconds"
HITS = 'cache_outcome=~"hbm_hit|waited_inflight|dram_hit"'
BATCH_REQUESTS = "relaygr_ranker_batch_requests"
BATCH_ROWS = "relaygr_ranker_batch_rows"


@dataclass(frozen=True, slots=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Chart:
    """One time-series panel: its title, what it answers, unit and queries."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    stacked: bool = False


def _size_quantiles(metric: str) -> tuple[Query, ...]:
    """Median, P99 and mean of a per-call size histogram over every ranker."""
    rate = f"rate({metric}_bucket[$__rate_interval])"
    return (
        Query(f"histogram_quantile(0.5, sum by (le) ({rate}))", "median"),
        Query(f"histogram_quantile(0.99, sum by (le) ({rate}))", "P99"),
        Query(
            f"sum(rate({metric}_sum[$__rate_interval])) "
            f"/ sum(rate({metric}_count[$__rate_interval]))",
            "mean",
        ),
    )


ROWS: tuple[tuple[str, tuple[Chart, ...]], ...] = (
    (
        "Ranking",
        (
            Chart(
                "Rank latency P99 by cache outcome",
                "Server-side time of a Rank on the rankers (HBM hit, DRAM hit, miss, ...)",
                "s",
                (
                    Query(
                        f"histogram_quantile(0.99, sum by (le, cache_outcome) "
                        f"(rate({RANK}_bucket[$__rate_interval])))",
                        "{{cache_outcome}}",
                    ),
                    Query("max(relaygr_trigger_slo_seconds)", "SLO"),
                ),
            ),
            Chart(
                "Ranks per second by cache outcome",
                "Hits per tier (hbm_hit, waited_inflight: HBM; dram_hit: DRAM) and misses",
                "reqps",
                (
                    Query(
                        f"sum by (cache_outcome) (rate({RANK}_count[$__rate_interval]))",
                        "{{cache_outcome}}",
                    ),
                ),
                stacked=True,
            ),
            Chart(
                "Cache hit ratio",
                "Share of Ranks served from a cached prefix in HBM or DRAM",
                "percentunit",
                (
                    Query(
                        f"sum(rate({RANK}_count{{{HITS}}}[$__rate_interval])) "
                        f"/ sum(rate({RANK}_count[$__rate_interval]))",
                        "hit ratio",
                    ),
                ),
            ),
        ),
    ),
    (
        "Relays",
        (
            Chart(
                "Retrieval events by admission reason",
                "The trigger's decisions: admitted and spare (relayed) and every reason to refuse",
                "ops",
                (
                    Query(
                        "sum by (reason) "
                        "(rate(relaygr_trigger_admissions_total[$__rate_interval]))",
                        "{{reason}}",
                    ),
                ),
                stacked=True,
            ),
            Chart(
                "Admitted PreInfers by outcome",
                "What became of admitted relays: resident on a ranker, refused for room, failed",
                "ops",
                (
                    Query(
                        "sum by (outcome) "
                        "(rate(relaygr_trigger_dispatches_total[$__rate_interval]))",
                        "{{outcome}}",
                    ),
                ),
                stacked=True,
            ),
            Chart(
                "Relays consumed and unconsumed",
                "Relays consumed by their Rank, and those that expired or were dropped unused",
                "ops",
                (
                    Query(
                        "sum(rate(relaygr_ranker_relays_consumed_total[$__rate_interval]))",
                        "consumed",
                    ),
                    Query(
                        "sum by (reason) "
                        "(rate(relaygr_ranker_relays_unconsumed_total[$__rate_interval]))",
                        "unconsumed {{reason}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Queues and memory",
        (
            Chart(
                "Queue depth",
                "Compute jobs waiting on each ranker by priority; the trigger's dispatch queue",
                "short",
                (
                    Query(
                        "sum by (instance, priority) (relaygr_ranker_queue_depth)",
                        "{{instance}} {{priority}}",
                    ),
                    Query(
                        "sum by (instance) (relaygr_trigger_dispatch_queue_depth)",
                        "dispatch {{instance}}",
                    ),
                ),
            ),
            Chart(
                "KV bytes per tier",
                "Prefix caches held, bytes pinned by relays, and the budget of each tier",
                "bytes",
                (
                    Query("sum by (tier) (relaygr_ranker_kv_used_bytes)", "used {{tier}}"),
                    Query("sum by (tier) (relaygr_ranker_kv_pinned_bytes)", "pinned {{tier}}"),
                    Query("sum by (tier) (relaygr_ranker_kv_budget_bytes)", "budget {{tier}}"),
                ),
            ),
            Chart(
                "KV drops by tier and reason",
                "Prefix caches leaving a tier: demoted, evicted, expired, superseded, too large",
                "ops",
                (
                    Query(
                        "sum by (tier, reason) "
                        "(rate(relaygr_ranker_kv_drops_total[$__rate_interval]))",
                        "{{tier}} {{reason}}",
                    ),
                ),
                stacked=True,
            ),
        ),
    ),
    (
        "Batching",
        (
            Chart(
                "Ranks per scoring call",
                "How many Ranks shared each model call (1: alone): median, P99 and mean over the"
                " rankers' calls. A batch is what queued while the worker was busy; no Rank is"
                " held back to fill one",
                "short",
                _size_quantiles(BATCH_REQUESTS),
            ),
            Chart(
                "Rows per scoring call",
                "Short-term behaviours + candidates (a full inference: its whole history +"
                " candidates) through each model call: median, P99 and mean",
                "short",
                _size_quantiles(BATCH_ROWS),
            ),
            Chart(
                "Ranks per scoring call P99 per ranker",
                "Batch size on each ranker: large where Ranks queue, 1 where the worker keeps up",
                "short",
                (
                    Query(
                        f"histogram_quantile(0.99, sum by (le, instance) "
                        f"(rate({BATCH_REQUESTS}_bucket[$__rate_interval])))",
                        "{{instance}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Per ranker",
        (
            Chart(
                "Rank latency P99 per ranker",
                "Server-side Rank time of each ranker, every outcome",
                "s",
                (
                    Query(
                        f"histogram_quantile(0.99, sum by (le, instance) "
                        f"(rate({RANK}_bucket[$__rate_interval])))",
                        "{{instance}}",
                    ),
                ),
            ),
            Chart(
                "Ranks per second per ranker",
                "Where the router sends Ranks",
                "reqps",
                (
                    Query(
                        f"sum by (instance) (rate({RANK}_count[$__rate_interval]))", "{{instance}}"
                    ),
                ),
                stacked=True,
            ),
            Chart(
                "HBM bytes per ranker",
                "Used and pinned bytes of each ranker's device tier",
                "bytes",
                (
                    Query('relaygr_ranker_kv_used_bytes{tier="hbm"}', "used {{instance}}"),
                    Query('relaygr_ranker_kv_pinned_bytes{tier="hbm"}', "pinned {{instance}}"),
                ),
            ),
            Chart(
                "Membership and etcd",
                "Rankers in each router's and trigger's view; services connected to etcd",
                "short",
                (
                    Query("relaygr_cluster_rankers", "rankers seen by {{job}} {{instance}}"),
                    Query("sum(relaygr_etcd_connected)", "services connected to etcd"),
                ),
            ),
        ),
    ),
)


def _panel(chart: Chart, panel_id: int) -> Panel:
    panel = (
        Panel()
        .id(panel_id)
        .title(chart.title)
        .description(chart.description)
        .unit(chart.unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(8)
    )
    if chart.stacked:  # rates of disjoint outcomes: their stack is the total
        panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(30)
    for ref, query in zip("ABCDEFGH", chart.queries, strict=False):
        panel = panel.with_target(
            Dataquery()
            .ref_id(ref)
            .expr(query.expr)
            .legend_format(query.legend)
            .datasource(DATASOURCE)
        )
    return panel


def build() -> Dashboard:
    dashboard = (
        Dashboard("RelayGR")
        .uid(UID)
        .description("Ranking latency, cache hits, relays, queues and KV memory of a RelayGR mesh")
        .tags(["relaygr"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    panel_id = 0
    for title, charts in ROWS:
        panel_id += 1
        dashboard = dashboard.with_row(Row(title).id(panel_id))
        for chart in charts:
            panel_id += 1
            dashboard = dashboard.with_panel(_panel(chart, panel_id))
    return dashboard


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DASHBOARD_PATH.is_file() or DASHBOARD_PATH.read_text() != text:
            print(f"{DASHBOARD_PATH} is stale: run `python tools/dashboard.py`", file=sys.stderr)
            return 1
        return 0
    DASHBOARD_PATH.write_text(text)
    print(f"wrote {DASHBOARD_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
