"""Writes helm/relaygr/values.schema.json, each service's `config` block from its config class.

The `<service>.config` schemas list every field of RankerConfig, RouterConfig and TriggerConfig
that the chart does not set itself, with its type and help text, and refuse any other key: a typo
or a stale field fails `helm install` instead of starting a service that ignores it. Run this
after changing a service config; `--check` (the chart tests) fails when the file is stale.

    python tools/chart_schema.py [--check]
"""

import argparse
import dataclasses
import enum
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from relaygr.authz import Role
from relaygr.cli_help import with_notes
from services.ranker.config import RankerConfig
from services.router.config import RouterConfig
from services.trigger.config import TriggerConfig

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "helm" / "relaygr" / "values.schema.json"

CONFIGS: dict[str, type] = {
    "ranker": RankerConfig,
    "router": RouterConfig,
    "trigger": TriggerConfig,
}

# Fields the chart derives (templates/_validate.tpl names the values that set each one).
MANAGED_COMMON = frozenset(
    {
        "listen", "etcd_endpoints", "etcd_prefix", "etcd_ca", "etcd_cert", "etcd_key",
        "etcd_user", "etcd_password", "metrics_port", "log_level", "log_format",
        "tls_cert", "tls_key", "tls_ca", "tls_server_name", "plaintext",
        "tls_client_ca", "authz", "trust_domain", "authz_entry_callers",
    }
)  # fmt: skip
MANAGED: dict[str, frozenset[str]] = {
    "ranker": MANAGED_COMMON
    | {"instance_id", "advertise_address", "device", "model_config", "checkpoint"},
    "router": MANAGED_COMMON,
    "trigger": MANAGED_COMMON | {"router_address"},
}
# Config fields the templates read (memory sizing, termination grace): values must hold them.
REQUIRED: dict[str, list[str]] = {
    "ranker": ["hbm_budget_mb", "dram_budget_mb", "drain_grace_s"],
    "router": ["drain_grace_s"],
    "trigger": ["drain_grace_s"],
}
_SCALARS: dict[Any, dict[str, Any]] = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bool: {"type": "boolean"},
    Path: {"type": "string"},
}


def field_schema(tp: Any) -> dict[str, Any]:
    """The JSON schema of a config field's type as a Helm value (None is written as "")."""
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return {"anyOf": [field_schema(inner), {"const": ""}]}
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return {"type": "array", "items": field_schema(args[0])}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [member.value for member in tp]}
    if tp in _SCALARS:
        return dict(_SCALARS[tp])
    raise TypeError(f"no schema for config type {tp!r}")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return None
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return None if value is None else value if not isinstance(value, Path) else str(value)


def config_schema(component: str) -> dict[str, Any]:
    """The schema of `<component>.config`: every field the chart leaves to the user."""
    cls = CONFIGS[component]
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in MANAGED[component]:
            continue
        schema = field_schema(hints[f.name])
        bound = f.metadata.get("bound")
        flag = f"flag --{f.name.replace('_', '-')}; service default: {json.dumps(_default(f))}"
        schema["description"] = with_notes(f.metadata.get("help", ""), bound, flag)
        properties[f.name] = schema
    return {
        "type": "object",
        "description": f"{cls.__name__} fields, passed as flags; see `relaygr {component} --help`",
        "properties": properties,
        "required": REQUIRED[component],
        "additionalProperties": False,
    }


# ---- the rest of the values -------------------------------------------------------------------

_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_OBJ = {"type": "object"}
_ARR = {"type": "array"}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_POS_INT = {"type": "integer", "minimum": 1}
_QUANTITY = {"type": ["string", "integer", "number"]}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


_RESOURCES = _obj(
    {
        "requests": {"type": "object", "additionalProperties": _QUANTITY},
        "limits": {"type": "object", "additionalProperties": _QUANTITY},
    }
)
_PROBES = _obj(
    {
        "periodSeconds": _POS_INT,
        "timeoutSeconds": _POS_INT,
        "failureThreshold": _POS_INT,
        "startupFailureThreshold": _POS_INT,
    },
    ["periodSeconds", "timeoutSeconds", "failureThreshold", "startupFailureThreshold"],
)
_PDB = _obj(
    {"enabled": _BOOL, "maxUnavailable": {"type": ["integer", "string"]}},
    ["enabled", "maxUnavailable"],
)
_SCHEDULING = {
    "podAnnotations": {"type": "object", "additionalProperties": _STR},
    "podLabels": {"type": "object", "additionalProperties": _STR},
    "nodeSelector": {"type": "object", "additionalProperties": _STR},
    "tolerations": _ARR,
    "affinity": _OBJ,
    "topologySpreadConstraints": _ARR,
    "priorityClassName": _STR,
    "extraEnv": {"type": "array", "items": _obj({"name": _STR, "value": _STR, "valueFrom": _OBJ})},
}
_GRACE = {"type": "integer", "minimum": 1}


def _service(component: str, extra: dict[str, Any]) -> dict[str, Any]:
    properties = {
        "replicas": {"type": "integer", "minimum": 0},
        "port": _PORT,
        "config": config_schema(component),
        "preStopSleepSeconds": {"type": "integer", "minimum": 0},
        "terminationGracePeriodSeconds": _GRACE,
        "resources": _RESOURCES,
        "podDisruptionBudget": _PDB,
        "probes": _PROBES,
        **_SCHEDULING,
        **extra,
    }
    return _obj(properties, ["replicas", "port", "config", "terminationGracePeriodSeconds"])


_STATELESS = {
    "autoscaling": _obj(
        {
            "enabled": _BOOL,
            "minReplicas": _POS_INT,
            "maxReplicas": _POS_INT,
            "targetCPUUtilizationPercentage": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        ["enabled"],
    ),
    "service": _obj(
        {
            "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
            "annotations": {"type": "object", "additionalProperties": _STR},
        }
    ),
}

_RANKER = {
    "device": {
        "enum": ["cpu", "npu", "cuda"],
        "description": "cpu, npu (Ascend) or cuda; npu and cuda need accelerator.resource",
    },
    "accelerator": _obj(
        {
            "resource": {
                "type": "string",
                "pattern": r"^$|^[a-z0-9.-]+/[A-Za-z0-9._-]+$",
                "description": "extended resource, e.g. huawei.com/Ascend910 or nvidia.com/gpu",
            },
            "count": _POS_INT,
        },
        ["resource", "count"],
    ),
    "advertise": {"enum": ["dns", "podIP"]},
    "memoryOverheadMi": {"type": "integer", "minimum": 0},
    "modelConfig": {"type": "object", "description": "ModelConfig fields (a seeded random model)"},
    "checkpoint": _obj({"volume": _OBJ, "path": _STR}),
    "podManagementPolicy": {"enum": ["Parallel", "OrderedReady"]},
}

_ETCD = _obj(
    {
        "prefix": {"type": "string", "pattern": "^/"},
        "bundled": _obj(
            {
                "enabled": _BOOL,
                "replicas": {"enum": [1, 3, 5], "description": "members: an odd number"},
                "image": _obj(
                    {
                        "repository": _STR,
                        "tag": {"type": "string", "minLength": 1},
                        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                    }
                ),
                "persistence": _obj(
                    {"size": _QUANTITY, "storageClass": _STR, "accessModes": _ARR}, ["size"]
                ),
                "quotaBackendBytes": _POS_INT,
                "resources": _RESOURCES,
                "podDisruptionBudget": _obj({"enabled": _BOOL}),
                "nodeSelector": {"type": "object", "additionalProperties": _STR},
                "tolerations": _ARR,
                "affinity": _OBJ,
            },
            ["enabled"],
        ),
        "external": _obj(
            {
                "enabled": _BOOL,
                "endpoints": {
                    "type": "array",
                    "items": {"type": "string", "pattern": r"^[^\s:/,]+:[0-9]+$"},
                    "description": "client endpoints as host:port (no scheme)",
                },
                "tls": _obj(
                    {
                        "enabled": _BOOL,
                        "secretName": _STR,
                        "clientCertificate": _BOOL,
                        "serviceCertificates": _BOOL,
                    }
                ),
                "roles": _obj(
                    {
                        "create": _BOOL,
                        "rootPasswordSecret": _obj({"name": _STR, "key": {"type": "string"}}),
                        "image": _obj(
                            {"repository": _STR, "tag": _STR, "pullPolicy": _STR},
                            ["repository", "tag"],
                        ),
                    }
                ),
                "auth": _obj(
                    {
                        "user": _STR,
                        "passwordSecret": _obj({"name": _STR, "key": {"type": "string"}}),
                    }
                ),
            },
            ["enabled"],
        ),
    },
    ["prefix", "bundled", "external"],
)


def values_schema() -> dict[str, Any]:
    properties: dict[str, Any] = {
        "global": _OBJ,
        "nameOverride": _STR,
        "fullnameOverride": _STR,
        "clusterDomain": {"type": "string", "minLength": 1},
        "image": _obj(
            {
                "repository": {"type": "string", "minLength": 1},
                "tag": _STR,
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            },
            ["repository"],
        ),
        "imagePullSecrets": _ARR,
        "serviceAccount": _obj({"create": _BOOL, "name": _STR, "annotations": _OBJ}),
        "automountServiceAccountToken": _BOOL,
        "podSecurityContext": _OBJ,
        "securityContext": _OBJ,
        "tmpSizeLimit": _QUANTITY,
        "logging": _obj(
            {
                "level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
                "format": {"enum": ["json", "text"]},
            },
            ["level", "format"],
        ),
        "metrics": _obj(
            {
                "enabled": _BOOL,
                "port": _PORT,
                "serviceMonitor": _obj({"enabled": _BOOL, "interval": _STR, "labels": _OBJ}),
                "prometheusRule": _obj({"enabled": _BOOL, "labels": _OBJ}),
                "grafanaDashboard": _obj({"enabled": _BOOL, "labels": _OBJ, "annotations": _OBJ}),
            },
            ["enabled", "port"],
        ),
        "tracing": _obj(
            {
                "otlpEndpoint": {
                    "type": "string",
                    "pattern": "^$|^https?://",
                    "description": "OTLP gRPC endpoint, http(s)://host:port; empty: off",
                },
                "sampler": {
                    "enum": [
                        "always_on",
                        "always_off",
                        "traceidratio",
                        "parentbased_always_on",
                        "parentbased_always_off",
                        "parentbased_traceidratio",
                    ]
                },
                "samplerArg": _STR,
                "uiUrl": _STR,
            }
        ),
        "tls": _obj(
            {
                "enabled": _BOOL,
                "secretName": _STR,
                "secrets": _obj({c: _STR for c in ("router", "trigger", "ranker")}),
                "clientCaSecretName": _STR,
                "authz": _obj(
                    {
                        "enabled": _BOOL,
                        "trustDomain": {"type": "string", "pattern": "^[a-z0-9._-]+$"},
                        "entryCallers": {
                            "type": "array",
                            "items": {"enum": [role.value for role in Role]},
                            "uniqueItems": True,
                        },
                    },
                    ["enabled", "trustDomain", "entryCallers"],
                ),
            },
            ["enabled"],
        ),
        "etcd": _ETCD,
        "networkPolicy": _obj({"enabled": _BOOL, "clients": _ARR, "metricsFrom": _ARR}),
        "router": _service("router", _STATELESS),
        "trigger": _service("trigger", _STATELESS),
        "ranker": _service("ranker", _RANKER),
    }
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "RelayGR chart values (generated by tools/chart_schema.py)",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = SCHEMA_PATH.read_text() if SCHEMA_PATH.exists() else ""
        if current != text:
            print(f"{SCHEMA_PATH} is stale: run `python tools/chart_schema.py`", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
