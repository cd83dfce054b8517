"""`relaygr ranker` as a user runs it: a real process, configured, healthy, drained on SIGTERM."""

import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from relaygr.cpu_quota import available_cpus
from relaygr.v1 import common_pb2, ranker_pb2, ranker_pb2_grpc
from relaygr.wire import pre_infer_request_to_proto, rank_request_to_proto
from tests.unit.ranker.factories import prefix, rank_input


def wait_for_port(process: subprocess.Popen[str], timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            raise AssertionError(f"service exited with {process.returncode}")
        if match := re.search(r"listening on port (\d+)", line):
            return int(match.group(1))
    raise AssertionError("service did not report its port in time")


def ranker_process(
    tmp_path: Path, args: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """`relaygr ranker` serving the tiny model on a free port, configured by a file (the tiny
    preset, 64 MiB device tier, quick calibration), then `env`, then `args`; its output on
    stdout."""
    config_file = tmp_path / "ranker.toml"
    config_file.write_text('model = "tiny"\nhbm_budget_mb = 64\ncalibration_lengths = [32, 64]\n')
    return subprocess.Popen(
        [
            sys.executable, "-m", "tooling.cli", "ranker", "--config", str(config_file),
            "--listen", "127.0.0.1:0", "--plaintext", "--device", "cpu", *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**(env or {}), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def test_ranker_process_serves_and_drains(tmp_path: Path, rng: np.random.Generator) -> None:
    process = ranker_process(
        tmp_path, ["--instance-id", "ranker-test"], {"RELAYGR_RANKER_DRAM_BUDGET_MB": "32"}
    )
    try:
        port = wait_for_port(process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(service="relaygr.v1.RankerService"))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            stub = ranker_pb2_grpc.RankerServiceStub(channel)
            info = stub.Describe(ranker_pb2.DescribeRequest())
            assert info.instance_id == "ranker-test"
            assert info.hbm.budget_bytes == 64 * 2**20  # from the file
            assert info.dram.budget_bytes == 32 * 2**20  # from the environment
            request = rank_input(rng, prefix(rng, 100))
            stub.PreInfer(pre_infer_request_to_proto(request.prefix), timeout=30)
            reply = stub.Rank(rank_request_to_proto(request), timeout=30)
            assert reply.cache_outcome == common_pb2.CACHE_OUTCOME_HBM_HIT
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        stop(process)


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--threads", "1"], {}, 1),
        (["--threads", "2"], {}, 2),
        ([], {"RELAYGR_RANKER_THREADS": "2"}, 2),
        ([], {}, available_cpus()),  # auto: the CPU quota, as this process sees it too
    ],
    ids=["flag-1", "flag-2", "env-2", "auto"],
)
def test_ranker_process_runs_the_intra_op_threads_it_is_given(
    tmp_path: Path, args: list[str], env: dict[str, str], expected: int
) -> None:
    process = ranker_process(tmp_path, args, env)
    try:
        port = wait_for_port(process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = ranker_pb2_grpc.RankerServiceStub(channel).Describe(
                ranker_pb2.DescribeRequest(), timeout=30
            )
        assert info.intra_op_threads == expected
    finally:
        stop(process)


def test_bad_config_is_refused_with_the_field_named(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tooling.cli", "ranker", "--hbm-budget-mb", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "hbm_budget_mb must be > 0" in result.stderr
