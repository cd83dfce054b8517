"""`relaygr trigger` as a user runs it: a real process, configured, healthy, drained on SIGTERM."""

import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relaygr.v1 import common_pb2, trigger_pb2, trigger_pb2_grpc
from tests.integration.etcd_server import EtcdServer
from tests.integration.test_ranker_process import wait_for_port


def test_trigger_process_serves_and_drains(etcd_server: EtcdServer) -> None:
    process = subprocess.Popen(
        [
            sys.executable, "-m", "tooling.cli", "trigger", "--listen", "127.0.0.1:0",
            "--etcd-endpoints", etcd_server.endpoint, "--router-address", "127.0.0.1:9",
            "--plaintext",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"RELAYGR_TRIGGER_MODE": "off", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    try:
        port = wait_for_port(process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="relaygr.v1.TriggerService")
            assert health.Check(request).status == health_pb2.HealthCheckResponse.SERVING
            stub = trigger_pb2_grpc.TriggerServiceStub(channel)
            event = trigger_pb2.RetrievalEvent(
                user_id="alice",
                long_term=common_pb2.Behaviours(item_ids=[1], actions=[0], timestamps=[5]),
            )
            decision = stub.OnRetrieval(event, timeout=10)
            assert decision.reason == trigger_pb2.ADMISSION_REASON_RELAY_DISABLED  # from the env
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_bad_trigger_config_is_refused_with_the_field_named() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tooling.cli", "trigger", "--slo-ms", "10", "--margin-ms", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "margin_ms must be in [0, slo_ms)" in result.stderr
