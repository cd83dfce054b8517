"""The local Prometheus's configuration, rule holds and exit messages (no process started)."""

import json
from pathlib import Path

from tooling.local.mesh import Exit, ProcessEntry
from tooling.local.prometheus import ALERTS_FILE, PrometheusSpec, held_rules, scrape_config

PROCESSES = [
    ProcessEntry("etcd", "etcd", "127.0.0.1:2379", 10, "http://127.0.0.1:2379/metrics"),
    ProcessEntry("ranker-0", "ranker", "127.0.0.1:5000", 11, "http://127.0.0.1:9100/metrics"),
    ProcessEntry("ranker-1", "ranker", "127.0.0.1:5001", 12, "http://127.0.0.1:9101/metrics"),
    ProcessEntry("router", "router", "127.0.0.1:5002", 13, None),  # serves no /metrics
    ProcessEntry("trigger", "trigger", "127.0.0.1:5003", 14, "http://127.0.0.1:9103/metrics"),
]


def test_one_job_per_role_each_target_named_after_its_process() -> None:
    config = scrape_config(PROCESSES, PrometheusSpec(scrape_interval="1s"), Path("/r.yaml"))
    assert config["global"] == {"scrape_interval": "1s", "evaluation_interval": "5s"}
    assert config["rule_files"] == ["/r.yaml"]
    jobs = {job["job_name"]: job["static_configs"] for job in config["scrape_configs"]}
    assert jobs == {
        "etcd": [{"targets": ["127.0.0.1:2379"], "labels": {"instance": "etcd"}}],
        "ranker": [
            {"targets": ["127.0.0.1:9100"], "labels": {"instance": "ranker-0"}},
            {"targets": ["127.0.0.1:9101"], "labels": {"instance": "ranker-1"}},
        ],
        "trigger": [{"targets": ["127.0.0.1:9103"], "labels": {"instance": "trigger"}}],
    }
    json.dumps(config)  # written as JSON, which Prometheus reads as YAML


def test_etcd_over_tls_is_not_scraped() -> None:
    tls = [ProcessEntry("etcd", "etcd", "127.0.0.1:2379", 10, "https://127.0.0.1:2379/metrics")]
    assert scrape_config(tls, PrometheusSpec(), ALERTS_FILE)["scrape_configs"] == []


def test_a_hold_replaces_every_alerts_for_and_nothing_else() -> None:
    text = ALERTS_FILE.read_text()
    held = held_rules(text, "1s")
    fors = [line.strip() for line in held.splitlines() if line.strip().startswith("for:")]
    assert fors and set(fors) == {"for: 1s"}
    assert len(fors) == text.count("\n        for: ")
    assert [line for line in held.splitlines() if "for:" not in line] == [
        line for line in text.splitlines() if "for:" not in line
    ]
    assert held_rules(text, None) == text


def test_an_exit_says_name_pid_and_code_or_signal() -> None:
    assert Exit("ranker-0", 42, 0).describe() == "ranker-0 (pid 42) exited with code 0"
    assert Exit("ranker-1", 43, -9).describe() == "ranker-1 (pid 43) killed by SIGKILL"
