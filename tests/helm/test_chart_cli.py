"""Chart, image and CLI stay in step: rendered args parse with each service's real config loader,
the Dockerfile's entry point is the one the chart calls, and values.schema.json is current."""

import argparse
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, NoReturn

import pytest

from relaygr.config import add_config_arguments, load_config
from relaygr.telemetry import tracing_settings
from services.ranker.config import ENV_PREFIX as RANKER_ENV
from services.router.config import ENV_PREFIX as ROUTER_ENV
from services.trigger.config import ENV_PREFIX as TRIGGER_ENV
from tests.helm.chart import (
    NAMESPACE,
    RELEASE,
    ROOT,
    SERVICES,
    VALUES_FILES,
    Rendered,
    expand,
    flag_values,
    pod_environment,
    render,
    values_of,
)
from tooling.cli import COMMANDS
from tools import chart_schema
from tools.chart_schema import CONFIGS

ENV_PREFIXES = {"ranker": RANKER_ENV, "router": ROUTER_ENV, "trigger": TRIGGER_ENV}
FILE_IDS = [f.stem for f in VALUES_FILES]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


class _Refused(AssertionError):
    pass


class _StrictParser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so the test names the refused flag."""

    def error(self, message: str) -> NoReturn:
        raise _Refused(message)


def parse_container(component: str, container: dict[str, Any], pod_name: str) -> Any:
    """The config the service would build from this container's args and environment."""
    env = pod_environment(container, pod_name)
    args = [expand(arg, env) for arg in container["args"]]
    assert args[0] == component, f"the subcommand must come first: {args[:2]}"
    parser = _StrictParser(prog=f"relaygr {component}")
    add_config_arguments(parser, CONFIGS[component], env_prefix=ENV_PREFIXES[component])
    try:
        namespace = parser.parse_args(args[1:])
    except _Refused as err:
        pytest.fail(f"relaygr {component} refuses the chart's args: {err}\nargs: {args[1:]}")
    return load_config(CONFIGS[component], namespace, env, ENV_PREFIXES[component])


@pytest.fixture(scope="module", params=VALUES_FILES, ids=FILE_IDS)
def case(request: pytest.FixtureRequest) -> tuple[dict[str, Any], Rendered]:
    return values_of([request.param]), render([request.param])


def test_rendered_args_build_each_services_config(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    for component in SERVICES:
        pod = f"{RELEASE}-relaygr-{component}-0"
        config = parse_container(component, rendered.container(component), pod)
        for key, value in values[component]["config"].items():
            got = getattr(config, key)
            got = list(got) if isinstance(got, tuple) else got
            assert got == value, f"{component}.config.{key}: values {value!r}, service {got!r}"
        assert config.listen == f"0.0.0.0:{values[component]['port']}"
        assert config.etcd_prefix == values["etcd"]["prefix"]
        assert config.metrics_port == values["metrics"]["port"]
        assert config.log_level == values["logging"]["level"]
        assert config.plaintext is not values["tls"]["enabled"]
        if values["tls"]["enabled"]:
            assert str(config.tls_ca) == "/etc/relaygr/tls/ca.crt"
        auth = values["etcd"]["external"]["auth"]
        if values["etcd"]["external"]["enabled"] and auth["user"]:
            secret = auth["passwordSecret"]
            assert config.etcd_user == auth["user"]
            assert config.etcd_password == f"secret:{secret['name']}/{secret['key']}"


def test_ranker_instance_id_is_the_pod_name(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    statefulset = rendered.one("StatefulSet", "ranker")
    for ordinal in (0, 3):
        pod = f"{statefulset['metadata']['name']}-{ordinal}"
        config = parse_container("ranker", rendered.container("ranker"), pod)
        assert config.instance_id == pod
        assert config.device == values["ranker"]["device"]
        if values["ranker"]["advertise"] == "dns":
            service = statefulset["spec"]["serviceName"]
            assert config.advertise_address == (
                f"{pod}.{service}.{NAMESPACE}.svc.cluster.local:{values['ranker']['port']}"
            )


def test_otel_environment_is_what_the_services_read(case: tuple[dict[str, Any], Rendered]) -> None:
    """The rendered OTEL_* variables pass the services' own reading of them."""
    values, rendered = case
    tracing = values["tracing"]
    for component in SERVICES:
        pod = f"{RELEASE}-relaygr-{component}-0"
        env = pod_environment(rendered.container(component), pod)
        settings = tracing_settings(f"relaygr-{component}", env)
        assert settings is not None and settings.exporters == ("otlp",)
        assert settings.endpoint == tracing["otlpEndpoint"] and settings.insecure
        assert settings.service_name == f"relaygr-{component}"
        assert settings.sampler_name == tracing["sampler"]
        assert settings.sampler_ratio == float(tracing["samplerArg"])
        assert settings.resource_attributes["k8s.pod.name"] == pod
    for component in SERVICES:  # the chart's default: no endpoint, tracing off
        env = pod_environment(render().container(component), "x")
        assert tracing_settings(f"relaygr-{component}", env) is None


def test_trigger_dials_every_ready_router(case: tuple[dict[str, Any], Rendered]) -> None:
    """The trigger resolves the routers' headless Service (every ready router pod), so its
    channel spreads PreInfers over the replicas and leaves one that drains."""
    values, rendered = case
    config = parse_container("trigger", rendered.container("trigger"), "trigger-abc")
    pods = rendered.service("router", pods=True)
    host = f"{pods['metadata']['name']}.{NAMESPACE}.svc.{values['clusterDomain']}"
    assert config.router_address == f"dns:///{host}:{values['router']['port']}"
    assert pods["spec"]["clusterIP"] == "None"
    assert not pods["spec"].get("publishNotReadyAddresses", False)
    routers = rendered.service_workload("router")["spec"]["template"]["metadata"]["labels"]
    assert pods["spec"]["selector"].items() <= routers.items()
    assert values["router"]["port"] in [p["port"] for p in pods["spec"]["ports"]]


def test_every_config_type_renders_as_a_flag_the_service_parses(tmp_path: Path) -> None:
    """Bools (both ways), lists, floats, big whole numbers and enums from YAML reach the config."""
    values = {
        "ranker": {"config": {"hbm_budget_mb": 1000000, "dram_budget_mb": 0.5,
                              "drain_grace_s": 2.5, "relay_enabled": False,
                              "calibration_lengths": [64, 128]}},
        "router": {"config": {"drain_grace_s": 10, "load_epsilon": 1e-05,
                              "placement": "random"}},
        "trigger": {"config": {"drain_grace_s": 10, "mode": "all"}},
    }  # fmt: skip
    rendered = render(values=values, tmp=tmp_path)
    ranker = parse_container("ranker", rendered.container("ranker"), "r-0")
    assert ranker.hbm_budget_mb == 1_000_000 and ranker.dram_budget_mb == 0.5
    assert ranker.relay_enabled is False and ranker.calibration_lengths == (64, 128)
    assert "--no-relay-enabled" in rendered.container("ranker")["args"]
    router = parse_container("router", rendered.container("router"), "x")
    assert router.load_epsilon == 1e-05 and router.placement.value == "random"
    assert parse_container("trigger", rendered.container("trigger"), "x").mode.value == "all"


def test_ranker_threads_are_its_cpu_request(case: tuple[dict[str, Any], Rendered]) -> None:
    values, rendered = case
    request = values["ranker"]["resources"]["requests"]["cpu"]  # whole CPUs in these files
    config = parse_container("ranker", rendered.container("ranker"), "r-0")
    assert config.threads == int(request)


@pytest.mark.parametrize(
    ("request_cpu", "threads"),
    [("2", 2), (2, 2), ("1500m", 1), ("500m", 1), ("2500m", 2), ("4000m", 4), (2.5, 2),
     ("0.5", 1), ("0.1", 1), (16, 16)],
)  # fmt: skip
def test_ranker_threads_round_the_cpu_request_down_to_at_least_one(
    request_cpu: str | float, threads: int, tmp_path: Path
) -> None:
    values = {"ranker": {"resources": {"requests": {"cpu": request_cpu}}}}
    container = render(values=values, tmp=tmp_path).container("ranker")
    assert flag_values(container["args"], "--threads") == [str(threads)]
    assert parse_container("ranker", container, "r-0").threads == threads


@pytest.mark.parametrize("threads", [0, 3])
def test_ranker_threads_set_in_config_win(threads: int, tmp_path: Path) -> None:
    values = {"ranker": {"config": {"threads": threads}, "resources": {"requests": {"cpu": "8"}}}}
    container = render(values=values, tmp=tmp_path).container("ranker")
    assert flag_values(container["args"], "--threads") == [str(threads)]
    assert parse_container("ranker", container, "r-0").threads == threads


def test_ranker_without_a_cpu_request_reads_its_own_quota(tmp_path: Path) -> None:
    values = {"ranker": {"resources": {"requests": None}}}
    container = render(values=values, tmp=tmp_path).container("ranker")
    assert flag_values(container["args"], "--threads") == []
    assert parse_container("ranker", container, "r-0").threads == 0  # auto


def test_values_schema_is_generated_from_the_configs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "chart_schema.py"), "--check"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    schema = json.loads(chart_schema.SCHEMA_PATH.read_text())
    for component, cls in CONFIGS.items():
        listed = set(schema["properties"][component]["properties"]["config"]["properties"])
        fields = {f for f in cls.__dataclass_fields__ if f not in chart_schema.MANAGED[component]}
        assert listed == fields


def test_managed_fields_are_real_config_fields() -> None:
    """Every field the chart sets itself exists, so a rename cannot silently drop a flag."""
    for component, cls in CONFIGS.items():
        missing = chart_schema.MANAGED[component] - set(cls.__dataclass_fields__)
        assert not missing, f"{cls.__name__} lacks {sorted(missing)}"
    template = (ROOT / "helm" / "relaygr" / "templates" / "_validate.tpl").read_text()
    block = template.split('define "relaygr.managedFields"')[1].split("{{- end -}}")[0]
    in_template = set(re.findall(r"^([a-z_]+):", block, re.MULTILINE))
    assert in_template == set().union(*chart_schema.MANAGED.values())


# ---- the image ------------------------------------------------------------------------------


def _final_stage() -> str:
    return DOCKERFILE.split("\nFROM ")[-1]


def _instruction(stage: str, name: str) -> str:
    (line,) = re.findall(rf"^{name} (.+)$", stage, re.MULTILINE)
    return line


def test_image_entrypoint_is_what_the_chart_calls() -> None:
    stage = _final_stage()
    entrypoint = json.loads(_instruction(stage, "ENTRYPOINT"))
    assert entrypoint == ["relaygr"]
    assert PYPROJECT["project"]["scripts"]["relaygr"] == "tooling.cli:main"
    assert json.loads(_instruction(stage, "CMD")) == ["--help"]
    user = _instruction(stage, "USER")
    values = values_of([])
    pod = values["podSecurityContext"]
    assert user == f"{pod['runAsUser']}:{pod['runAsGroup']}"
    exposed = {int(p) for p in _instruction(stage, "EXPOSE").split()}
    assert {values[c]["port"] for c in SERVICES} | {values["metrics"]["port"]} <= exposed
    for file in VALUES_FILES:
        rendered = render([file])
        for component in SERVICES:
            container = rendered.container(component)
            assert "command" not in container, "the image's ENTRYPOINT must stay in force"
            assert container["args"][0] == component and component in COMMANDS


@pytest.mark.parametrize("component", SERVICES)
def test_entry_point_runs_and_knows_every_chart_flag(component: str) -> None:
    """`relaygr <service> --help` through the console script pip installs (as in the image)."""
    script = Path(sys.executable).parent / "relaygr"
    result = subprocess.run(
        [str(script), component, "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    flags = set(re.findall(r"(--[a-z][a-z0-9-]*)", result.stdout))
    for file in VALUES_FILES:
        for arg in render([file]).container(component)["args"][1:]:
            flag = arg.split("=", 1)[0]
            assert flag in flags, f"{flag} is not an option of relaygr {component}"


def test_image_pins_match_the_project() -> None:
    deps = dict(re.match(r"([A-Za-z0-9_.-]+)==(\S+)", d).groups()  # type: ignore[union-attr]
                for d in [*PYPROJECT["project"]["dependencies"],
                          *PYPROJECT["project"]["optional-dependencies"]["dev"]])  # fmt: skip
    assert f"torch=={deps['torch']}" in DOCKERFILE
    assert f"grpcio-tools=={deps['grpcio-tools']}" in DOCKERFILE
    # The image generates its stubs with the same protoc call as `make proto`.
    makefile = (ROOT / "Makefile").read_text()
    for option in ("-Iprotos", "--python_out=.", "--pyi_out=.", "--grpc_python_out=."):
        assert option in makefile and option in DOCKERFILE
    assert "relaygr.v1 stubs" in DOCKERFILE and "py.typed" in DOCKERFILE
    # No build tooling in the final stage: stubs and wheels are built in the builder.
    stage = _final_stage()
    assert "grpc_tools" not in stage and "pip install" not in stage
    assert "COPY --from=builder /opt/relaygr /opt/relaygr" in stage


def test_build_context_holds_what_the_dockerfile_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.MULTILINE)
    sources = {src.rstrip("/") for line in copied for src in line.split()}
    assert sources <= allowed, sources - allowed
    packages = PYPROJECT["tool"]["setuptools"]["packages"]
    assert {name.split(".")[0] for name in packages} | {"protos"} <= sources
