"""The chart's alerts and dashboard: promtool checks and unit-tests the one rule file, the
PrometheusRule and the dashboard ConfigMap carry exactly the committed files, and the dashboard
is what tools/dashboard.py generates."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import CHART, ROOT, Rendered, render
from tools import dashboard

ALERTS = CHART / "files" / "alerts.yaml"
ALERTS_TEST = Path(__file__).with_name("alerts_test.yaml")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install prometheus; .ci/run installs it)",
)
ENABLED = {
    "metrics": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus"}},
        "grafanaDashboard": {"enabled": True},
    }
}


def _alert_names() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    result = _promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alert_names())} rules found" in result.stdout


@needs_promtool
def test_every_alert_fires_in_its_promtool_test_and_stays_quiet_on_healthy_input() -> None:
    result = _promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_promtool_tests_cover_every_alert_both_ways() -> None:
    """promtool passes an expectation of silence for an alert that does not exist: so every
    alert tested must exist, and every alert must be expected both firing and quiet."""
    names = _alert_names()
    assert len(names) == len(set(names)) >= 8
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            assert check["alertname"] in names, check["alertname"]
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fires == set(names)
    assert quiet == set(names)


def test_every_alert_has_a_summary_and_a_runbook_section() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line[4:].strip().lower()).replace(" ", "-")
        for line in doc.splitlines()
        if line.startswith("### ")
    }
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            annotations = rule["annotations"]
            assert annotations["summary"], rule["alert"]
            assert annotations["runbook"] == f"docs/observability.md#{rule['alert'].lower()}"
            assert rule["alert"].lower() in anchors, f"no runbook section for {rule['alert']}"


@pytest.fixture(scope="module")
def enabled(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    """The chart with the ServiceMonitor, the PrometheusRule and the dashboard switched on."""
    return render(values=ENABLED, tmp=tmp_path_factory.mktemp("values"))


def test_the_prometheus_rule_is_the_rule_file(enabled: Rendered) -> None:
    (rule,) = enabled.of_kind("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())


def test_the_service_monitor_names_each_job_after_its_component(enabled: Rendered) -> None:
    (monitor,) = enabled.of_kind("ServiceMonitor")
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/component"


def test_the_dashboard_config_map_carries_the_dashboard_for_the_grafana_sidecar(
    enabled: Rendered,
) -> None:
    maps = [m for m in enabled.of_kind("ConfigMap") if m["metadata"]["name"].endswith("-dashboard")]
    (config_map,) = maps
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["relaygr.json"])
    assert shipped == json.loads(dashboard.DASHBOARD_PATH.read_text())
    assert shipped["uid"] == dashboard.UID


def test_monitoring_objects_are_opt_in() -> None:
    rendered = render()
    assert not rendered.of_kind("PrometheusRule")
    assert not [
        m for m in rendered.of_kind("ConfigMap") if m["metadata"]["name"].endswith("-dashboard")
    ]


def test_the_committed_dashboard_is_what_the_generator_writes() -> None:
    assert dashboard.DASHBOARD_PATH.read_text() == dashboard.render(), (
        "stale: run `python tools/dashboard.py`"
    )


def test_the_dashboard_covers_latency_hits_relays_queues_bytes_and_rankers() -> None:
    exprs = " ".join(dashboard_exprs())
    for metric in (
        "relaygr_ranker_rank_latency_seconds_bucket",
        "relaygr_ranker_rank_latency_seconds_count",
        "relaygr_trigger_admissions_total",
        "relaygr_ranker_queue_depth",
        "relaygr_ranker_kv_used_bytes",
        "relaygr_ranker_batch_requests_bucket",
        "relaygr_ranker_batch_rows_bucket",
    ):
        assert metric in exprs
    assert "by (le, instance)" in exprs  # per ranker


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the committed dashboard."""
    panels = json.loads(dashboard.DASHBOARD_PATH.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


# Metric names in PromQL: RelayGR's own, and the `up` Prometheus records per target.
_NAME = re.compile(r"\b(relaygr_[a-z0-9_]+|up)\b")


def named_metrics() -> set[str]:
    """Every metric (series name: a histogram's `_bucket`, a counter's `_total`) named by an
    alert's expression or a dashboard panel's query: each must be one a service exports
    (tests/unit/ranker/test_metrics_reads.py checks the ranker's in-process,
    tests/integration/test_prometheus.py every service's against a real Prometheus)."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    exprs = [rule["expr"] for group in groups for rule in group["rules"]]
    exprs += dashboard_exprs()
    assert len(exprs) >= 8 + 15
    return {name for expr in exprs for name in _NAME.findall(expr)}
