"""The import rules of docs/architecture.md §10, read from the source (AST, no imports executed).

- Three floors, from the bottom: the base `relaygr`, the services (`services.<name>`), and the
  tooling (`tooling`: the command line, local mesh and simulator; `bench`: the benchmarks). A
  module imports only its own floor and those below it;
- a service never imports another service;
- the cores (model, KV store, scheduler, engine, placement, relay room, router forwarder,
  admission policy, cost model) reach no transport and no tracing library, directly or through
  the project modules they import.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("ranker", "router", "trigger")
FLOORS = (("relaygr",), ("services",), ("tooling", "bench"))  # bottom first: packages per floor
CORES = (
    "services.ranker.core",
    "services.ranker.batching",
    "services.ranker.core_types",
    "services.ranker.flight",
    "services.ranker.planner",
    "services.ranker.queues",
    "services.ranker.handoff_order",
    "services.ranker.engine",
    "services.ranker.kv_store",
    "services.ranker.model",
    "services.ranker.cost_model",
    "services.ranker.plan",
    "services.ranker.cost_fit",
    "services.ranker.cost_learner",
    "services.ranker.fetch",
    "services.ranker.transfer_cost",
    "services.ranker.transfer",
    "services.ranker.handoff",
    "services.ranker.handoff_intake",
    "services.ranker.peers",
    "relaygr.versions",
    "services.ranker.host_lock",
    "services.trigger.policy",
    "services.router.forward",
    "services.router.attempts",
    "services.router.routes",
    "relaygr.placement",
    "relaygr.room",
)
FORBIDDEN_IN_CORES = ("grpc", "opentelemetry", "aetcd")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    files = [p for packages in FLOORS for top in packages for p in ROOT.glob(f"{top}/**/*.py")]
    return {module_name(p): p for p in files if "relaygr/v1" not in p.as_posix()}


def imports_of(path: Path) -> set[str]:
    """Every module `path` names in an import statement (absolute; the project uses no relative
    imports), at any depth: a lazy import inside a function counts."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            assert node.module is not None
            found.add(node.module)
            # `from pkg import module` imports pkg.module.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = project_modules()
IMPORTS = {name: imports_of(path) for name, path in MODULES.items()}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def floor(name: str) -> int | None:
    """The floor of a project module (0 the base), None for anything else (a library)."""
    return next(
        (i for i, packages in enumerate(FLOORS) if any(within(name, top) for top in packages)),
        None,
    )


def service(name: str) -> str | None:
    """The service a module belongs to (`ranker`), None outside a service's folder."""
    parts = name.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 1 else None


def violations(name: str) -> list[str]:
    here = floor(name)
    assert here is not None
    bad = []
    for target in IMPORTS[name]:
        there = floor(target)
        if there is None:
            continue
        if there > here:
            bad.append(f"{name} (floor {here}) imports {target} (floor {there}): upwards")
        elif None is not service(name) != service(target) is not None:
            bad.append(f"{name} imports {target}: one service never imports another")
    return bad


def test_the_rules_see_every_floor() -> None:
    assert {floor(name) for name in MODULES} == set(range(len(FLOORS)))
    assert {name.split(".")[0] for name in MODULES} == {top for tops in FLOORS for top in tops}
    assert {service(name) for name in MODULES} >= set(SERVICES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_only_downwards(name: str) -> None:
    assert violations(name) == []


def test_an_upward_or_sideways_import_is_caught() -> None:
    probes = {
        "services.trigger.__probe__": {"services.ranker.engine"},
        "relaygr.__probe__": {"tooling.local.mesh"},
        "services.router.__probe2__": {"tooling.sim.fleet"},
        "relaygr.__probe2__": {"services.ranker.engine"},
    }
    IMPORTS.update(probes)
    try:
        for probe in probes:
            assert violations(probe), probe
    finally:
        for probe in probes:
            del IMPORTS[probe]


def reach(name: str) -> set[str]:
    """Every module `name` imports, following project modules transitively."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        for target in IMPORTS.get(current, ()):
            if target not in seen:
                seen.add(target)
                if target in MODULES:
                    todo.append(target)
    return seen


@pytest.mark.parametrize("core", CORES)
def test_cores_reach_no_transport_or_tracing(core: str) -> None:
    assert core in MODULES, f"{core} moved: update CORES"
    reached = sorted(
        target
        for target in reach(core)
        if any(within(target, lib) for lib in FORBIDDEN_IN_CORES) or target.startswith("relaygr.v1")
    )
    assert reached == [], f"{core} reaches {reached}"


# The synchronous cores own no thread and never await; they run the model through their drivers.
SYNC_CORES = (
    "services.ranker.core",
    "services.ranker.batching",
    "services.ranker.core_types",
    "services.ranker.flight",
    "services.ranker.planner",
    "services.ranker.queues",
    "services.ranker.handoff_order",
    "services.router.attempts",
    "services.router.routes",
    "services.trigger.policy",
    "relaygr.room",
    "relaygr.versions",
)
FORBIDDEN_IN_SYNC_CORES = ("asyncio", "threading", "concurrent", "torch")


@pytest.mark.parametrize("core", SYNC_CORES)
def test_sync_cores_reach_no_threads_loops_or_torch(core: str) -> None:
    assert core in MODULES, f"{core} moved: update SYNC_CORES"
    reached = sorted(
        t for t in reach(core) | {core} if any(within(t, lib) for lib in FORBIDDEN_IN_SYNC_CORES)
    )
    assert reached == [], f"{core} reaches {reached}"


# Service configs are plain option dataclasses, read by the cores (the admission policy takes
# its TriggerConfig): what starts servers, telemetry and etcd clients from them lives elsewhere.
OPTIONS = (
    "relaygr.service_options",
    "services.ranker.config",
    "services.router.config",
    "services.trigger.config",
)


@pytest.mark.parametrize("options", OPTIONS)
def test_configs_reach_no_transport_or_tracing(options: str) -> None:
    assert options in MODULES, f"{options} moved: update OPTIONS"
    forbidden = [t for t in reach(options) if any(within(t, lib) for lib in FORBIDDEN_IN_CORES)]
    assert sorted(forbidden) == [], f"{options} reaches {sorted(forbidden)}"


def cycles() -> list[list[str]]:
    """Every group of project modules that import each other in a circle (Tarjan's strongly
    connected components over the import graph, imports under TYPE_CHECKING included)."""
    edges = {name: sorted(t for t in IMPORTS[name] if t in MODULES) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for name in sorted(MODULES):
        if name not in index:
            visit(name)
    return found


def test_no_import_cycle() -> None:
    assert cycles() == []


def test_an_import_cycle_is_caught() -> None:
    IMPORTS["relaygr.__probe_a__"] = {"relaygr.__probe_b__"}
    IMPORTS["relaygr.__probe_b__"] = {"relaygr.__probe_a__"}
    MODULES["relaygr.__probe_a__"] = MODULES["relaygr.__probe_b__"] = ROOT
    try:
        assert ["relaygr.__probe_a__", "relaygr.__probe_b__"] in cycles()
    finally:
        for probe in ("relaygr.__probe_a__", "relaygr.__probe_b__"):
            del IMPORTS[probe], MODULES[probe]
