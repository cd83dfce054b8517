"""The chart rendered for every values file: lint, Kubernetes schemas, what each manifest says."""

import json
import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from google.protobuf import json_format

from relaygr.etcd.roles import chart_commands, etcdctl_commands
from relaygr.v1 import common_pb2
from services.ranker.model_config import ModelConfig
from tests.helm.chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    SERVICES,
    VALUES_DIR,
    VALUES_FILES,
    Rendered,
    all_containers,
    flag_value,
    flag_values,
    helm,
    pod_spec,
    render,
    values_of,
)
from tools.chart_schema import CONFIGS

# The chart's kubeVersion floor, a mid version and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.27.0", "1.31.0", kubernetes_validate.latest_version())
# Custom resources: no schema offline; their shape is asserted below instead.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
FILE_IDS = [f.stem for f in VALUES_FILES]
CHART_NAME = f"{RELEASE}-relaygr"


def test_values_files_cover_every_device_and_etcd_mode() -> None:
    names = {f.stem for f in VALUES_FILES}
    assert {"cpu", "ascend", "nvidia", "external-etcd"} <= names
    devices = {values_of([f])["ranker"]["device"] for f in VALUES_FILES}
    assert devices == {"cpu", "npu", "cuda"}


@pytest.fixture(scope="module", params=VALUES_FILES, ids=FILE_IDS)
def case(request: pytest.FixtureRequest) -> tuple[dict[str, Any], Rendered]:
    file: Path = request.param
    return values_of([file]), render([file])


@pytest.fixture(scope="module")
def default_render() -> Rendered:
    return render()


@pytest.mark.parametrize("file", VALUES_FILES, ids=FILE_IDS)
def test_helm_lint_strict(file: Path) -> None:
    result = helm("lint", "--strict", str(CHART), "-f", str(file))
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_passes_the_kubernetes_schema(
    case: tuple[dict[str, Any], Rendered], version: str
) -> None:
    _, rendered = case
    checked = 0
    for manifest in rendered.manifests:
        if manifest["kind"] in CRD_KINDS:
            continue
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = "/".join(str(p) for p in err.path)
            pytest.fail(f"{name} invalid for Kubernetes {version} at {path}: {err.message}")
        checked += 1
    assert checked >= 9  # service account, 3 services, 3 workloads, PDB, ...


# Switches the values files leave at their defaults, rendered and validated too.
VARIANTS: dict[str, dict[str, Any]] = {
    "metrics-off": {"metrics": {"enabled": False}, "networkPolicy": {"enabled": True}},
    "no-service-account": {"serviceAccount": {"create": False}},
    "pod-ip-and-checkpoint": {
        "ranker": {
            "advertise": "podIP",
            "checkpoint": {
                "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                "path": "/v1",
            },
        }
    },
    "external-etcd-roles": {
        "tls": {"enabled": True, "secretName": "mesh-tls"},
        "etcd": {
            "bundled": {"enabled": False},
            "external": {
                "enabled": True,
                "endpoints": ["etcd.infra:2379"],
                "tls": {"enabled": True, "secretName": "etcd-root", "serviceCertificates": True},
                "roles": {"create": True, "rootPasswordSecret": {"name": "etcd-root-pw"}},
            },
        },
    },
    "external-etcd-ca-only": {
        "etcd": {
            "bundled": {"enabled": False},
            "external": {
                "enabled": True,
                "endpoints": ["etcd.infra:2379"],
                "tls": {"enabled": True, "secretName": "ca", "clientCertificate": False},
            },
        }
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_pass_the_kubernetes_schema(variant: str, tmp_path: Path) -> None:
    rendered = render(values=VARIANTS[variant], tmp=tmp_path)
    for manifest in rendered.manifests:
        kubernetes_validate.validate(manifest, K8S_VERSIONS[-1], strict=True)
    args = rendered.container("ranker")["args"]
    if variant == "pod-ip-and-checkpoint":
        assert flag_value(args, "--advertise-address") == "$(POD_IP):50061"
        assert flag_value(args, "--checkpoint") == "/var/lib/relaygr/checkpoint/v1"
    if variant == "external-etcd-roles":
        for component in SERVICES:
            args = rendered.container(component)["args"]
            assert flag_value(args, "--etcd-cert") == "/etc/relaygr/tls/tls.crt"
            assert flag_value(args, "--etcd-key") == "/etc/relaygr/tls/tls.key"
        (job,) = rendered.of_kind("Job")
        spec = pod_spec(job)
        run = [[c["command"][0], *c["args"]] for c in spec["initContainers"] + spec["containers"]]
        assert run == [["etcdctl", *c] for c in etcdctl_commands("/relaygr")]
        assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install"
    if variant == "external-etcd-ca-only":
        assert flag_value(args, "--etcd-ca") == "/etc/relaygr/etcd-tls/ca.crt"
        assert not flag_values(args, "--etcd-cert")


def test_the_charts_etcd_commands_are_written_from_the_roles_table() -> None:
    """files/etcd-roles.json is `python -m relaygr.etcd.roles`'s output (rerun it when the
    table in relaygr/etcd/roles.py changes)."""
    assert (CHART / "files" / "etcd-roles.json").read_text() == chart_commands()


def test_kinds_rendered_by_default(default_render: Rendered) -> None:
    kinds = sorted((m["kind"], m["metadata"]["name"]) for m in default_render.manifests)
    assert ("StatefulSet", f"{CHART_NAME}-ranker") in kinds
    assert ("StatefulSet", f"{CHART_NAME}-etcd") in kinds
    assert ("Deployment", f"{CHART_NAME}-router") in kinds
    assert ("Deployment", f"{CHART_NAME}-trigger") in kinds
    # TLS material is only ever referenced: the chart never writes a Secret.
    assert not default_render.of_kind("Secret")


def test_workloads_have_probes_on_their_grpc_port(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    for component in SERVICES:
        container = rendered.container(component)
        port = values[component]["port"]
        assert flag_value(container["args"], "--listen") == f"0.0.0.0:{port}"
        assert {"name": "grpc", "containerPort": port, "protocol": "TCP"} in container["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            handler = container[probe]
            if values["tls"]["enabled"]:  # the grpc probe is plaintext: the mTLS exec check
                command = handler["exec"]["command"]
                assert command[1].endswith("grpc_health_probe.py")
                assert f"--port={port}" in command
            else:
                assert handler["grpc"] == {"port": port, "service": ""}, (component, probe)


def test_liveness_outlasts_the_drain(case: tuple[dict[str, Any], Rendered]) -> None:
    """A draining server answers NOT_SERVING; liveness must not kill it before the grace ends."""
    _, rendered = case
    for component in SERVICES:
        workload = rendered.service_workload(component)
        liveness = rendered.container(component)["livenessProbe"]
        grace = pod_spec(workload)["terminationGracePeriodSeconds"]
        assert liveness["failureThreshold"] * liveness["periodSeconds"] > grace


def test_every_container_has_requests_and_limits(case: tuple[dict[str, Any], Rendered]) -> None:
    _, rendered = case
    for workload, container in all_containers(rendered):
        resources = container["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[kind]), (workload["metadata"]["name"], kind)


def test_ranker_memory_covers_its_tiers(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    ranker = values["ranker"]
    resources = rendered.container("ranker")["resources"]
    host_tiers = ranker["config"]["dram_budget_mb"]
    if ranker["device"] == "cpu":  # the device tier is host memory too
        host_tiers += ranker["config"]["hbm_budget_mb"]
    expected = f"{host_tiers + ranker['memoryOverheadMi']}Mi"
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == expected


def test_accelerator_resource_named_by_values(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    ranker = values["ranker"]
    container = rendered.container("ranker")
    assert flag_value(container["args"], "--device") == ranker["device"]
    extended = {
        kind: {k: v for k, v in container["resources"][kind].items() if "/" in k}
        for kind in ("requests", "limits")
    }
    if ranker["device"] == "cpu":
        assert extended == {"requests": {}, "limits": {}}
    else:
        expected = {ranker["accelerator"]["resource"]: ranker["accelerator"]["count"]}
        assert extended == {"requests": expected, "limits": expected}
        vendor = {"npu": "huawei.com/Ascend", "cuda": "nvidia.com/"}[ranker["device"]]
        assert ranker["accelerator"]["resource"].startswith(vendor)
    spec = pod_spec(rendered.service_workload("ranker"))
    assert spec.get("nodeSelector", {}) == ranker["nodeSelector"]
    assert spec.get("tolerations", []) == ranker["tolerations"]
    # No other workload asks for an accelerator.
    for workload, other in all_containers(rendered):
        if workload["metadata"]["name"] != f"{CHART_NAME}-ranker":
            assert not any("/" in k for k in other["resources"]["limits"])


def test_etcd_endpoints_wired_the_same_into_every_service(
    case: tuple[dict[str, Any], Rendered],
) -> None:
    values, rendered = case
    etcd = values["etcd"]
    seen = {
        component: flag_values(rendered.container(component)["args"], "--etcd-endpoints")
        for component in SERVICES
    }
    if etcd["bundled"]["enabled"]:
        statefulset = rendered.one("StatefulSet", "etcd")
        name, service = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
        assert rendered.service("etcd")["spec"]["clusterIP"] == "None"
        domain = f"{service}.{NAMESPACE}.svc.{values['clusterDomain']}"
        members = [f"{name}-{i}.{domain}" for i in range(statefulset["spec"]["replicas"])]
        expected = ",".join(f"{m}:2379" for m in members)
        etcd_args = pod_spec(statefulset)["containers"][0]["args"]
        initial = flag_value(etcd_args, "--initial-cluster")
        assert initial == ",".join(f"{m.split('.')[0]}=http://{m}:2380" for m in members)
        assert flag_value(etcd_args, "--initial-cluster-state") == "new"
        assert len(members) == etcd["bundled"]["replicas"]
        (claim,) = statefulset["spec"]["volumeClaimTemplates"]
        assert (
            claim["spec"]["resources"]["requests"]["storage"]
            == etcd["bundled"]["persistence"]["size"]
        )
        (mount,) = pod_spec(statefulset)["containers"][0]["volumeMounts"]
        assert mount["name"] == claim["metadata"]["name"]
        assert flag_value(etcd_args, "--data-dir").startswith(mount["mountPath"] + "/")
    else:
        assert not [m for m in rendered.manifests if m["metadata"]["name"].endswith("-etcd")]
        expected = ",".join(etcd["external"]["endpoints"])
    assert seen == {component: [expected] for component in SERVICES}
    for component in SERVICES:
        assert flag_value(rendered.container(component)["args"], "--etcd-prefix") == etcd["prefix"]


def test_otlp_and_prometheus_wiring(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    endpoint = values["tracing"]["otlpEndpoint"]
    assert endpoint, "every shipped values file exports traces"
    for component in SERVICES:
        container = rendered.container(component)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
        assert env["OTEL_SERVICE_NAME"] == f"relaygr-{component}"
        assert env["OTEL_TRACES_SAMPLER"] == values["tracing"]["sampler"]
        assert "OTEL_SDK_DISABLED" not in env
        port = values["metrics"]["port"]
        assert flag_value(container["args"], "--metrics-port") == str(port)
        annotations = rendered.service_workload(component)["spec"]["template"]["metadata"][
            "annotations"
        ]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)


def test_tracing_off_by_default(default_render: Rendered) -> None:
    for component in SERVICES:
        env = {e["name"]: e.get("value") for e in default_render.container(component)["env"]}
        assert env["OTEL_SDK_DISABLED"] == "true"
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env


def test_ranker_identity_from_the_statefulset_pod(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    statefulset = rendered.one("StatefulSet", "ranker")
    container = rendered.container("ranker")
    assert flag_value(container["args"], "--instance-id") == "$(POD_NAME)"
    pod_name = next(e for e in container["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    headless = rendered.service("ranker")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    domain = f"{statefulset['spec']['serviceName']}.{NAMESPACE}.svc.{values['clusterDomain']}"
    port = values["ranker"]["port"]
    assert flag_value(container["args"], "--advertise-address") == (
        f"$(POD_NAME).{domain}:{port}"
        if values["ranker"]["advertise"] == "dns"
        else f"$(POD_IP):{port}"
    )


def test_security_context_and_writable_tmp(case: tuple[dict[str, Any], Rendered]) -> None:
    _, rendered = case
    for workload, container in all_containers(rendered):
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        if workload["metadata"]["name"].endswith("-etcd"):
            continue
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]


def test_tls_secret_mounted_never_inlined(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    assert not rendered.of_kind("Secret")
    for component in SERVICES:
        args = rendered.container(component)["args"]
        volumes = {v["name"]: v for v in pod_spec(rendered.service_workload(component))["volumes"]}
        if values["tls"]["enabled"]:
            assert "--plaintext" not in args
            secret = values["tls"]["secrets"][component] or values["tls"]["secretName"]
            assert volumes["tls"]["secret"]["secretName"] == secret
            assert flag_value(args, "--tls-ca") == "/etc/relaygr/tls/ca.crt"
            authz = values["tls"]["authz"]
            assert ("--authz" in args) == authz["enabled"] != ("--no-authz" in args)
            assert flag_value(args, "--trust-domain") == authz["trustDomain"]
            assert flag_value(args, "--authz-entry-callers") == ",".join(authz["entryCallers"])
        else:
            assert "--plaintext" in args and "tls" not in volumes
        external = values["etcd"]["external"]
        if external["enabled"] and external["tls"]["enabled"]:
            assert volumes["etcd-tls"]["secret"]["secretName"] == external["tls"]["secretName"]


def test_drain_fits_the_termination_grace(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    for component in SERVICES:
        spec = pod_spec(rendered.service_workload(component))
        container = rendered.container(component)
        drain = float(flag_value(container["args"], "--drain-grace-s"))
        sleep = values[component]["preStopSleepSeconds"]
        assert spec["terminationGracePeriodSeconds"] > sleep + drain
        if sleep:
            assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(sleep)]


def test_optional_objects_follow_values(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    hpas = {
        m["spec"]["scaleTargetRef"]["name"] for m in rendered.of_kind("HorizontalPodAutoscaler")
    }
    for component in ("router", "trigger"):
        name = f"{CHART_NAME}-{component}"
        scaled = values[component]["autoscaling"]["enabled"]
        assert (name in hpas) == scaled
        assert ("replicas" in rendered.service_workload(component)["spec"]) == (not scaled)
    pdbs = {m["metadata"]["name"] for m in rendered.of_kind("PodDisruptionBudget")}
    for component in SERVICES:
        enabled = values[component]["podDisruptionBudget"]["enabled"]
        assert (f"{CHART_NAME}-{component}" in pdbs) == enabled
    policies = rendered.of_kind("NetworkPolicy")
    assert bool(policies) == values["networkPolicy"]["enabled"]
    monitors = rendered.of_kind("ServiceMonitor")
    assert bool(monitors) == values["metrics"]["serviceMonitor"]["enabled"]
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        for component in SERVICES:
            ports = {p["name"] for p in rendered.service(component)["spec"]["ports"]}
            assert "metrics" in ports


# Every call the services make, (caller, callee) on the callee's gRPC port: the trigger's
# PreInfer to the router; the router's and the trigger's PreInfer, Rank, Describe to rankers;
# rankers' Handoff and Fetch to rankers. "clients" are callers outside the release.
CALL_PATHS = {
    ("clients", "router"), ("clients", "trigger"), ("trigger", "router"),
    ("router", "ranker"), ("trigger", "ranker"), ("ranker", "ranker"),
}  # fmt: skip
CLIENTS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "recsys"}}}]


def _grpc_callers(policy: dict[str, Any]) -> set[str]:
    """Who the policy admits to the gRPC port: release components, or "clients" for the
    configured client peers (and for a rule with no `from`: anyone)."""
    (rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc"]
    if "from" not in rule:
        return {"clients", *SERVICES}
    callers = set()
    for peer in rule["from"]:
        if peer in CLIENTS:
            callers.add("clients")
            continue
        labels = peer["podSelector"]["matchLabels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE, peer
        assert labels["app.kubernetes.io/name"] == "relaygr", peer
        callers.add(labels["app.kubernetes.io/component"])
    return callers


def test_network_policies_admit_every_call_path_and_no_other() -> None:
    """With networkPolicy.clients set (tls.yaml), each service's gRPC port admits exactly the
    callers the service graph has: rankers take rankers too (hand-off, peer fetch)."""
    rendered = render([f for f in VALUES_FILES if f.stem == "tls"])
    admitted = set()
    for component in SERVICES:
        policy = rendered.one("NetworkPolicy", component)
        selected = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        assert selected == component
        admitted |= {(caller, component) for caller in _grpc_callers(policy)}
    assert admitted == CALL_PATHS


def test_model_config_mounted_as_json(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    model = values["ranker"]["modelConfig"]
    args = rendered.container("ranker")["args"]
    if not model:
        assert not flag_values(args, "--model-config")
        return
    (configmap,) = [m for m in rendered.of_kind("ConfigMap") if m["metadata"]["name"].endswith(
        "-model")]  # fmt: skip
    data = json.loads(configmap["data"]["model_config.json"])
    assert data == model
    ModelConfig.from_dict(data)  # a field the model does not know fails here
    assert flag_value(args, "--model-config") == "/etc/relaygr/model/model_config.json"


def test_configs_cover_every_service() -> None:
    assert set(CONFIGS) == set(SERVICES)


def _render_notes(tmp_path: Path, files: list[Path]) -> str:
    """NOTES.txt as `helm install` would print it (helm template skips NOTES: wrap it)."""
    chart = tmp_path / "relaygr"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "test.notes" -}}\n' + notes + "{{- end -}}\n"
    )
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data:\n  notes: {{ include "test.notes" . | quote }}\n'
    )
    args = [arg for f in files for arg in ("-f", str(f))]
    out = helm("template", RELEASE, str(chart), "--namespace", NAMESPACE, *args).stdout
    (configmap,) = [d for d in yaml.safe_load_all(out) if d and d["metadata"]["name"] == "notes"]
    return configmap["data"]["notes"]


@pytest.mark.parametrize("file", VALUES_FILES, ids=FILE_IDS)
def test_notes_tell_how_to_call_the_router_and_find_traces(file: Path, tmp_path: Path) -> None:
    values = values_of([file])
    notes = _render_notes(tmp_path, [file])
    router = f"{CHART_NAME}-router"
    assert f"port-forward svc/{router} 50051:50051" in notes
    payloads = re.findall(r"-d '(.*?)'", notes, re.DOTALL)
    methods = re.findall(r"localhost:50051 (relaygr\.v1\.RouterService/\w+)", notes)
    assert methods == ["relaygr.v1.RouterService/PreInfer", "relaygr.v1.RouterService/Rank"]
    # The example requests are valid JSON for the contract's messages.
    json_format.Parse(payloads[0], common_pb2.PreInferRequest())
    rank = json_format.Parse(payloads[1], common_pb2.RankRequest())
    assert len(rank.candidate_ids) == 3 and rank.long_term.item_ids
    assert values["tracing"]["otlpEndpoint"] in notes
    assert "relaygr-router" in notes
    if values["tls"]["enabled"]:
        assert "-cacert ca.crt -cert client.crt -key client.key" in notes
        domain = f"{NAMESPACE}.svc.cluster.local"
        assert f"ranker: *.{CHART_NAME}-ranker.{domain}" in notes
        for component in ("router", "trigger"):  # the name it is called by, headless or not
            name = f"{CHART_NAME}-{component}"
            assert f"{component}: {name}.{domain}, {name}-pods.{domain}" in notes
    else:
        assert "TLS=-plaintext" in notes


def test_a_second_ranker_set_joins_the_first_releases_etcd_with_its_own_checkpoint() -> None:
    # Not among VALUES_FILES: a release of rankers only, which the whole-chart cases don't fit.
    rendered = render([VALUES_DIR / "model-versions" / "ranker-set.yaml"])
    for manifest in rendered.manifests:
        kubernetes_validate.validate(manifest, K8S_VERSIONS[-1], strict=True)
    kinds = {(m["kind"], m["metadata"]["name"]) for m in rendered.manifests}
    assert ("StatefulSet", f"{CHART_NAME}-ranker") in kinds
    assert not any(kind == "StatefulSet" and "etcd" in name for kind, name in kinds)
    for manifest in rendered.manifests:
        if manifest["kind"] == "Deployment":  # the first release's routers and triggers serve
            assert manifest["spec"]["replicas"] == 0, manifest["metadata"]["name"]
    args = rendered.container("ranker")["args"]
    assert flag_value(args, "--checkpoint") == "/var/lib/relaygr/checkpoint/v2"
    assert flag_value(args, "--etcd-prefix") == "/relaygr"
    assert flag_value(args, "--etcd-endpoints").startswith(
        "relaygr-etcd-0.relaygr-etcd.recsys.svc.cluster.local:2379,"
    )
