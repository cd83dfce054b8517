"""Values the chart must refuse, each with a message that names what to change."""

from pathlib import Path
from typing import Any

import pytest

from services.ranker.config import RankerConfig
from services.router.config import RouterConfig
from tests.helm.chart import helm, render, render_error, template_command

# The chart's default linger, where a config leaves it out, must be the service's own.
ROUTER_LINGER_S = RouterConfig(plaintext=True).health_linger_s
RANKER_LINGER_S = RankerConfig(plaintext=True).health_linger_s

EXTERNAL = {"enabled": True, "endpoints": ["etcd.infra:2379"]}

# (id, values, a piece of the message helm must print)
BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "bundled-and-external-etcd",
        {"etcd": {"external": EXTERNAL}},
        "etcd.bundled.enabled and etcd.external.enabled are both true; choose one",
    ),
    (
        "external-endpoints-with-bundled-etcd",
        {"etcd": {"external": {"endpoints": ["etcd.infra:2379"]}}},
        "etcd.external.endpoints is set but the bundled etcd is enabled",
    ),
    (
        "no-etcd",
        {"etcd": {"bundled": {"enabled": False}}},
        "neither etcd.bundled.enabled nor etcd.external.enabled is true",
    ),
    (
        "external-etcd-without-endpoints",
        {"etcd": {"bundled": {"enabled": False}, "external": {"enabled": True}}},
        "etcd.external.enabled is true but etcd.external.endpoints is empty",
    ),
    (
        "external-etcd-endpoint-with-scheme",
        {
            "etcd": {
                "bundled": {"enabled": False},
                "external": {"enabled": True, "endpoints": ["http://etcd:2379"]},
            }
        },
        "etcd.external.endpoints.0: Does not match pattern",
    ),
    (
        "etcd-user-without-password-secret",
        {
            "etcd": {
                "bundled": {"enabled": False},
                "external": {**EXTERNAL, "auth": {"user": "relaygr"}},
            }
        },
        "etcd.external.auth.user needs etcd.external.auth.passwordSecret.name",
    ),
    (
        "even-etcd-cluster",
        {"etcd": {"bundled": {"replicas": 2}}},
        "etcd.bundled.replicas must be one of the following: 1, 3, 5",
    ),
    (
        "pdb-on-a-single-etcd-member",
        {"etcd": {"bundled": {"replicas": 1}}},
        "a PodDisruptionBudget on a 1-member etcd blocks every node drain",
    ),
    (
        "npu-without-accelerator",
        {"ranker": {"device": "npu"}},
        "ranker.device=npu needs an accelerator resource: set ranker.accelerator.resource",
    ),
    (
        "cuda-without-accelerator",
        {"ranker": {"device": "cuda"}},
        "ranker.device=cuda needs an accelerator resource",
    ),
    (
        "npu-with-nvidia-resource",
        {"ranker": {"device": "npu", "accelerator": {"resource": "nvidia.com/gpu"}}},
        "ranker.device=npu but ranker.accelerator.resource=nvidia.com/gpu is not an Ascend",
    ),
    (
        "cuda-with-ascend-resource",
        {"ranker": {"device": "cuda", "accelerator": {"resource": "huawei.com/Ascend910"}}},
        "is not an NVIDIA resource",
    ),
    (
        "cpu-with-accelerator",
        {"ranker": {"accelerator": {"resource": "nvidia.com/gpu"}}},
        "ranker.device=cpu computes on the CPU but ranker.accelerator.resource=nvidia.com/gpu",
    ),
    (
        "unknown-device",
        {"ranker": {"device": "tpu"}},
        'ranker.device must be one of the following: "cpu", "npu", "cuda"',
    ),
    (
        "ranker-memory-set-by-hand",
        {"ranker": {"resources": {"limits": {"cpu": "4", "memory": "4Gi"}}}},
        "ranker.resources.limits.memory is derived from config.hbm_budget_mb",
    ),
    (
        "tls-without-secret",
        {"tls": {"enabled": True, "secrets": {"router": "r", "ranker": "k"}}},
        "tls.enabled needs tls.secrets.trigger or tls.secretName",
    ),
    (
        "etcd-roles-without-root-password",
        {
            "etcd": {
                "bundled": {"enabled": False},
                "external": {
                    "enabled": True,
                    "endpoints": ["e:2379"],
                    "tls": {"enabled": True, "secretName": "e"},
                    "roles": {"create": True},
                },
            }
        },
        "etcd.external.roles.create needs",
    ),
    (
        "etcd-service-certificates-without-tls",
        {
            "etcd": {
                "bundled": {"enabled": False},
                "external": {
                    "enabled": True,
                    "endpoints": ["e:2379"],
                    "tls": {"enabled": True, "secretName": "e", "serviceCertificates": True},
                },
            }
        },
        "etcd.external.tls.serviceCertificates needs",
    ),
    (
        "tls-with-pod-ip-advertise",
        {"tls": {"enabled": True, "secretName": "s"}, "ranker": {"advertise": "podIP"}},
        "ranker.advertise=podIP cannot be verified under TLS",
    ),
    (
        "grace-shorter-than-drain",
        {"router": {"terminationGracePeriodSeconds": 12}},
        "router.terminationGracePeriodSeconds=12 must exceed preStopSleepSeconds +"
        f" config.health_linger_s + config.drain_grace_s = {5 + ROUTER_LINGER_S + 10:g}",
    ),
    (
        "ranker-grace-shorter-than-drain-and-hand-off",
        {"ranker": {"terminationGracePeriodSeconds": 24}},
        "ranker.terminationGracePeriodSeconds=24 must exceed preStopSleepSeconds +"
        " config.health_linger_s + config.drain_grace_s"
        f" + min(config.handoff_budget_s, config.drain_grace_s) = {RANKER_LINGER_S + 25:g}",
    ),
    (
        "pdb-on-a-single-replica",
        {"router": {"replicas": 1}},
        "a PodDisruptionBudget with 1 replica(s) blocks every node drain",
    ),
    (
        "hpa-min-above-max",
        {"router": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 3}}},
        "router.autoscaling.minReplicas=5 exceeds maxReplicas=3",
    ),
    (
        "model-config-and-checkpoint",
        {
            "ranker": {
                "modelConfig": {"num_layers": 2},
                "checkpoint": {"volume": {"emptyDir": {}}, "path": "m"},
            }
        },
        "set either ranker.modelConfig or ranker.checkpoint, not both",
    ),
    (
        "chart-managed-config-field",
        {"router": {"config": {"listen": "0.0.0.0:1"}}},
        "router.config: Additional property listen is not allowed",
    ),
    (
        "misspelt-config-field",
        {"ranker": {"config": {"hbm_budget": 100}}},
        "ranker.config: Additional property hbm_budget is not allowed",
    ),
    (
        "config-field-of-the-wrong-type",
        {"trigger": {"config": {"mode": "sometimes"}}},
        "trigger.config.mode must be one of the following",
    ),
    (
        "password-as-a-value",
        {"ranker": {"config": {"etcd_password": "hunter2"}}},
        "ranker.config: Additional property etcd_password is not allowed",
    ),
]


@pytest.mark.parametrize(("values", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_values_fail_with_a_clear_message(
    values: dict[str, Any], message: str, tmp_path: Path
) -> None:
    error = render_error(values, tmp_path)
    assert message in error, error


def test_the_template_checks_hold_without_the_schema(tmp_path: Path) -> None:
    """`--skip-schema-validation` must not let a chart-managed field through."""
    values = {"ranker": {"config": {"instance_id": "r0"}}}
    result = helm(*template_command((), values, tmp_path), "--skip-schema-validation", check=False)
    assert result.returncode != 0
    assert "ranker.config.instance_id is set by the chart from the pod name" in result.stderr


def test_good_neighbours_of_the_bad_values_render(tmp_path: Path) -> None:
    """Each refusal is specific: the nearest valid values render."""
    good = [
        {"etcd": {"bundled": {"enabled": False}, "external": EXTERNAL}},
        {"ranker": {"device": "npu", "accelerator": {"resource": "huawei.com/Ascend910B"}}},
        {"ranker": {"device": "cuda", "accelerator": {"resource": "nvidia.com/mig-1g.10gb"}}},
        {"tls": {"enabled": True, "secretName": "s"}},
        {"router": {"terminationGracePeriodSeconds": 16}},
        {"router": {"replicas": 1, "podDisruptionBudget": {"enabled": False}}},
        {"ranker": {"checkpoint": {"volume": {"emptyDir": {}}, "path": "m"}}},
        {"etcd": {"bundled": {"replicas": 1, "podDisruptionBudget": {"enabled": False}}}},
    ]
    for values in good:
        assert render(values=values, tmp=tmp_path).workloads(), values
