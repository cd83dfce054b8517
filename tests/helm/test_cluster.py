"""Smoke test on a real cluster: install the chart, wait for its pods, relay once via the router.

Runs only where $KUBECONFIG names a reachable cluster and $RELAYGR_TEST_IMAGE an image it can
pull (`make image`, then e.g. `kind load docker-image relaygr:0.1.0`); skipped with the reason
otherwise. It installs into a fresh namespace and deletes that namespace afterwards.
"""

import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from relaygr.v1 import common_pb2, router_pb2_grpc
from tests.helm.chart import CHART, VALUES_DIR, helm, helm_binary, values_of

pytestmark = pytest.mark.k8s

RELEASE = "smoke"
READY_TIMEOUT_S = 900  # image pulls, three etcd members, ranker calibration
VALUES = VALUES_DIR / "cpu.yaml"


def _cluster_or_skip() -> tuple[object, str]:
    """(kubernetes ApiClient, image) or a skip naming what is missing."""
    kubeconfig = os.environ.get("KUBECONFIG", "")
    if not kubeconfig or not all(Path(p).is_file() for p in kubeconfig.split(os.pathsep)):
        pytest.skip(f"no Kubernetes cluster: $KUBECONFIG is {kubeconfig or 'unset'}")
    image = os.environ.get("RELAYGR_TEST_IMAGE", "")
    if not image:
        pytest.skip("set RELAYGR_TEST_IMAGE to a relaygr image the cluster can pull (make image)")
    from kubernetes import client, config

    try:
        config.load_kube_config()
        api = client.ApiClient()
        client.VersionApi(api).get_code(_request_timeout=10)
    except Exception as err:  # any failure to reach the API server means: no cluster here
        pytest.skip(f"cluster in $KUBECONFIG unreachable: {err}")
    return api, image


@contextmanager
def _namespace(api: object) -> Iterator[str]:
    from kubernetes import client

    core = client.CoreV1Api(api)
    name = f"relaygr-smoke-{secrets.token_hex(3)}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        helm("uninstall", RELEASE, "--namespace", name, check=False)
        core.delete_namespace(name)


def _wait_until_ready(api: object, namespace: str, expected_pods: int) -> None:
    """Watch the release's pods until `expected_pods` are Ready (no polling sleeps)."""
    from kubernetes import client, watch

    core = client.CoreV1Api(api)
    ready: dict[str, bool] = {}
    phases: dict[str, str] = {}
    stream = watch.Watch().stream(
        core.list_namespaced_pod,
        namespace,
        label_selector=f"app.kubernetes.io/instance={RELEASE}",
        timeout_seconds=READY_TIMEOUT_S,
    )
    for event in stream:
        pod = event["object"]
        conditions = pod.status.conditions or []
        ready[pod.metadata.name] = any(c.type == "Ready" and c.status == "True" for c in conditions)
        phases[pod.metadata.name] = pod.status.phase
        if event["type"] == "DELETED":
            ready.pop(pod.metadata.name, None)
        if sum(ready.values()) >= expected_pods:
            return
    pytest.fail(f"not all {expected_pods} pods Ready within {READY_TIMEOUT_S}s: {phases}")


@contextmanager
def _port_forward(namespace: str, service: str, port: int) -> Iterator[int]:
    """kubectl port-forward to a Service; yields the local port once kubectl reports it."""
    kubectl = helm_binary().parent / "kubectl"
    process = subprocess.Popen(
        [str(kubectl), "port-forward", "--namespace", namespace, f"svc/{service}", f":{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        for line in process.stdout:  # blocks until kubectl prints or exits
            found = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", line)
            if found:
                yield int(found.group(1))
                return
        pytest.fail(f"kubectl port-forward exited: {process.wait()}")
    finally:
        process.terminate()
        process.wait(timeout=30)


def _relay(address: str) -> None:
    """PreInfer a user's prefix, then Rank with it: the Rank must find the relayed cache."""
    long_term = common_pb2.Behaviours(
        item_ids=[11, 12, 13, 14], actions=[1, 1, 2, 1],
        timestamps=[1_700_000_000, 1_700_000_060, 1_700_000_120, 1_700_000_180],
    )  # fmt: skip
    common = {"user_id": "smoke-user", "user_features": [3, 7], "long_term": long_term}
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = router_pb2_grpc.RouterServiceStub(channel)
        pre = stub.PreInfer(common_pb2.PreInferRequest(request_id="pre", **common), timeout=60)
        assert pre.prefix_tokens > 0
        rank = stub.Rank(
            common_pb2.RankRequest(
                request_id="rank",
                short_term=common_pb2.Behaviours(
                    item_ids=[15], actions=[1], timestamps=[1_700_000_200]
                ),
                candidate_ids=[101, 102, 103],
                request_ts=1_700_000_210,
                **common,
            ),
            timeout=60,
        )
    assert rank.instance_id == pre.instance_id
    assert rank.cache_outcome in (
        common_pb2.CACHE_OUTCOME_HBM_HIT,
        common_pb2.CACHE_OUTCOME_WAITED_INFLIGHT,
    ), common_pb2.CacheOutcome.Name(rank.cache_outcome)
    assert rank.scores and all(len(task.scores) == 3 for task in rank.scores)


def test_install_wait_and_relay_once() -> None:
    api, image = _cluster_or_skip()
    repository, _, tag = image.rpartition(":")
    values = values_of([VALUES])
    expected_pods = (
        values["router"]["replicas"] + values["trigger"]["replicas"]
        + values["ranker"]["replicas"] + values["etcd"]["bundled"]["replicas"]
    )  # fmt: skip
    with _namespace(api) as namespace:
        helm(
            "install", RELEASE, str(CHART), "--namespace", namespace, "-f", str(VALUES),
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "tracing.otlpEndpoint=",
        )  # fmt: skip
        _wait_until_ready(api, namespace, expected_pods)
        router = f"{RELEASE}-relaygr-router"
        with _port_forward(namespace, router, values["router"]["port"]) as port:
            _relay(f"127.0.0.1:{port}")
