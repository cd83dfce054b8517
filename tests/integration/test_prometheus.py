"""A real Prometheus scraping a real local mesh: every metric that the alerts and the dashboard
name is there, and killing a ranker fires the membership alert."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from tests.helm.test_monitoring import named_metrics
from tests.integration.process_mesh import free_ports, tiny_mesh
from tests.polling import eventually
from tooling.local.mesh import LocalMesh
from tooling.local.prometheus import (
    INSTALL_HINT,
    LocalPrometheus,
    PrometheusSpec,
    find_prometheus_binary,
)

pytestmark = pytest.mark.skipif(
    find_prometheus_binary() is None, reason=f"{INSTALL_HINT} (.ci/run installs it)"
)
MEMBERSHIP = "RelayGRRankerMissingFromMembership"


def _firing(prometheus: LocalPrometheus, alert: str) -> list[dict[str, str]]:
    return [
        a["labels"]
        for a in prometheus.alerts()
        if a["labels"]["alertname"] == alert and a["state"] == "firing"
    ]


def test_prometheus_scrapes_every_named_metric_and_a_killed_ranker_fires_the_membership_alert(
    private_tempdir: Path,
) -> None:
    spec, _ = tiny_mesh(
        rankers=2, metrics_base_port=free_ports(4), ranker_args=("--lease-ttl-s", "1")
    )
    fast = PrometheusSpec(scrape_interval="500ms", evaluation_interval="500ms", alert_hold="1s")
    with LocalMesh(spec) as mesh, LocalPrometheus(mesh.processes(), fast) as prometheus:
        services = {"etcd", "ranker-0", "ranker-1", "router", "trigger"}

        def all_up() -> bool:
            health = prometheus.target_health()
            return set(health) == services and set(health.values()) == {"up"}

        asyncio.run(eventually(all_up, "every process scraped", timeout_s=30))
        wanted = named_metrics()
        assert {"relaygr_cluster_rankers", "relaygr_trigger_slo_seconds", "up"} <= wanted

        def scraped() -> bool:  # names appear once their first sample is in
            return wanted <= prometheus.metric_names()

        try:
            asyncio.run(eventually(scraped, "every named metric scraped", timeout_s=20))
        except AssertionError:
            missing = sorted(wanted - prometheus.metric_names())
            raise AssertionError(
                f"named by alerts or dashboard, never scraped: {missing}"
            ) from None
        ranked = prometheus.api("query", query='count(up{job="ranker"})')["result"]
        assert ranked[0]["value"][1] == "2"
        assert not _firing(prometheus, MEMBERSHIP)  # healthy: quiet

        mesh.kill("ranker-1")  # its lease expires within a second; the views drop it

        def fired() -> bool:
            return {labels["job"] for labels in _firing(prometheus, MEMBERSHIP)} == {
                "router",
                "trigger",
            }

        asyncio.run(eventually(fired, "the membership alert fires for router and trigger", 60))
        (alert,) = [
            a
            for a in prometheus.alerts()
            if a["labels"]["alertname"] == MEMBERSHIP and a["labels"]["job"] == "router"
        ]
        assert alert["annotations"]["summary"] == (
            "router router sees 1 rankers, fewer than Prometheus scrapes"
        )


@pytest.mark.usefixtures("private_tempdir")
def test_relaygr_up_prometheus_prints_a_url_that_scrapes_the_mesh(tmp_path: Path) -> None:
    printed = tmp_path / "up.out"
    with printed.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "tooling.cli", "up", "--rankers", "1", "--model", "tiny",
             "--ranker-arg", "--device=cpu", "--ranker-arg", "--calibration-lengths=32,64",
             "--prometheus"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        urls: list[str] = []

        def url_printed() -> bool:
            assert up.poll() is None, f"relaygr up exited:\n{printed.read_text()}"
            urls[:] = re.findall(
                r"^prometheus (http://127\.0\.0\.1:\d+) ", printed.read_text(), re.M
            )
            return bool(urls)

        asyncio.run(eventually(url_printed, "relaygr up printed the Prometheus URL", 300))

        def all_up() -> bool:
            with urllib.request.urlopen(f"{urls[0]}/api/v1/targets", timeout=5) as reply:
                targets = json.load(reply)["data"]["activeTargets"]
            jobs = {t["labels"]["job"] for t in targets if t["health"] == "up"}
            return jobs == {"etcd", "ranker", "router", "trigger"}

        asyncio.run(eventually(all_up, "every process scraped", timeout_s=30))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
    assert up.returncode == 0, printed.read_text()
    assert not list(Path(tempfile.gettempdir()).glob("relaygr-prometheus-*"))
