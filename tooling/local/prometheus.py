"""A Prometheus server beside the local mesh: scrapes each of its processes on loopback, with
RelayGR's alerting rules (helm/relaygr/files/alerts.yaml, the chart's own copy) loaded.

`relaygr up --prometheus` starts one; tests start one with short intervals and alert holds.
The `prometheus` binary is Debian's `prometheus` package (`.ci/run` installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tooling.local.mesh import LOOPBACK, Exit, ProcessEntry
from tooling.local.ports import free_port
from tooling.local.processes import dying_with_parent, terminate

# The one rule file: the chart renders it into its PrometheusRule; here it is loaded as is.
ALERTS_FILE = Path(__file__).resolve().parents[2] / "helm" / "relaygr" / "files" / "alerts.yaml"
_FOR_LINE = re.compile(r"^(\s*for:\s*)\S+\s*$", re.MULTILINE)
_STOP_TIMEOUT_S = 10.0
INSTALL_HINT = "no prometheus binary: on Debian, apt-get install prometheus"


def find_prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@dataclass(frozen=True, slots=True)
class PrometheusSpec:
    """How often to scrape and evaluate, and how long an alert must hold before it fires."""

    scrape_interval: str = "5s"
    evaluation_interval: str = "5s"
    alert_hold: str | None = None  # replaces every alert's `for:`; None: the rule file's own
    rules: Path = ALERTS_FILE
    start_timeout_s: float = 30.0


def scrape_config(
    processes: Sequence[ProcessEntry], spec: PrometheusSpec, rule_file: Path
) -> dict[str, Any]:
    """The Prometheus configuration: one job per role (job="ranker", ... as the chart's
    ServiceMonitor names them), each process its own target labelled instance=<its name>.
    Processes that serve no plain-HTTP /metrics (none, or etcd over TLS) are left out."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for entry in processes:
        if entry.metrics is None or not entry.metrics.startswith("http://"):
            continue
        target = urllib.parse.urlsplit(entry.metrics).netloc
        jobs.setdefault(entry.role, []).append(
            {"targets": [target], "labels": {"instance": entry.name}}
        )
    return {
        "global": {
            "scrape_interval": spec.scrape_interval,
            "evaluation_interval": spec.evaluation_interval,
        },
        "rule_files": [str(rule_file)],
        "scrape_configs": [
            {"job_name": role, "metrics_path": "/metrics", "static_configs": targets}
            for role, targets in jobs.items()
        ],
    }


def held_rules(text: str, hold: str | None) -> str:
    """The rule file `text` with every `for:` set to `hold` (None: unchanged)."""
    return text if hold is None else _FOR_LINE.sub(lambda m: f"{m.group(1)}{hold}", text)


@dataclass(slots=True)
class LocalPrometheus:
    """One Prometheus process on 127.0.0.1 scraping `processes`, with a temporary config and
    data directory that `stop` removes. `start` returns once it answers /-/ready."""

    processes: Sequence[ProcessEntry]
    spec: PrometheusSpec = field(default_factory=PrometheusSpec)
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    _tmp: Path | None = None
    _exit_reported: bool = False

    def __enter__(self) -> LocalPrometheus:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> None:
        binary = find_prometheus_binary()
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self._tmp = Path(tempfile.mkdtemp(prefix="relaygr-prometheus-"))
        try:
            rules = self._tmp / "alerts.yaml"
            rules.write_text(held_rules(self.spec.rules.read_text(), self.spec.alert_hold))
            config = self._tmp / "prometheus.yml"
            # JSON is YAML: no YAML writer needed.
            config.write_text(json.dumps(scrape_config(self.processes, self.spec, rules), indent=2))
            self.port = free_port()
            log = self._tmp / "prometheus.log"
            with log.open("wb") as out:
                self.process = subprocess.Popen(
                    dying_with_parent(
                        [
                            binary,
                            f"--config.file={config}",
                            f"--storage.tsdb.path={self._tmp / 'data'}",
                            f"--web.listen-address={LOOPBACK}:{self.port}",
                        ]
                    ),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            self._wait_ready(log)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, log: Path) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.spec.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = log.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2.0) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)  # poll interval under a deadline
        raise TimeoutError(f"prometheus not ready in {self.spec.start_timeout_s}s")

    def reap(self) -> list[Exit]:
        """Its exit, once, if it exited (so it stays no zombie)."""
        process = self.process
        if process is None or self._exit_reported or process.poll() is None:
            return []
        self._exit_reported = True
        return [Exit("prometheus", process.pid, process.returncode)]

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            terminate(process, _STOP_TIMEOUT_S)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # -- its HTTP API ----------------------------------------------------------------------

    def api(self, path: str, **params: str) -> Any:
        """The `data` of one GET of the HTTP API (`/api/v1/<path>`)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10.0) as reply:
            body = json.load(reply)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus /api/v1/{path}: {body}")
        return body["data"]

    def metric_names(self) -> set[str]:
        """Every metric name it has scraped."""
        return set(self.api("label/__name__/values"))

    def target_health(self) -> dict[str, str]:
        """Each active target's health ("up", "down", "unknown") by its instance label."""
        targets = self.api("targets")["activeTargets"]
        return {t["labels"]["instance"]: t["health"] for t in targets}

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts: each with `labels`, `annotations` and `state`."""
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts
