"""Who may call what: the role an identity names, and the one table of methods and the roles
allowed to call them (pure; `relaygr.authz_grpc` enforces it on every server).

An identity is a SPIFFE-style URI in the caller's certificate,
`spiffe://<trust domain>/relaygr/<role>/<instance>`. The service graph is the authorization
graph: prefixes move between rankers only, rankers take PreInfer and Rank from routers and
triggers (and from rankers, where a ranker forwards), and callers outside the mesh reach the
router and the trigger only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from relaygr import service_names
from relaygr.errors import ConfigError

SPIFFE_SCHEME = "spiffe://"
PATH_ROOT = "relaygr"
DEFAULT_TRUST_DOMAIN = "tooling.local"


class Role(StrEnum):
    """What a process is, as its certificate names it."""

    RANKER = "ranker"
    ROUTER = "router"
    TRIGGER = "trigger"
    CLIENT = "client"


ROLE_NAMES = ", ".join(role.value for role in Role)


@dataclass(frozen=True, slots=True)
class Identity:
    """One process: its role and instance within a trust domain."""

    trust_domain: str
    role: Role
    instance: str

    @property
    def uri(self) -> str:
        return f"{SPIFFE_SCHEME}{self.trust_domain}/{PATH_ROOT}/{self.role.value}/{self.instance}"


def parse_identity(uri: str) -> Identity | None:
    """The identity `uri` names; None when it is not `spiffe://<td>/relaygr/<role>/<instance>`
    with a known role and a non-empty instance."""
    if not uri.startswith(SPIFFE_SCHEME):
        return None
    parts = uri[len(SPIFFE_SCHEME) :].split("/")
    if len(parts) != 4 or parts[1] != PATH_ROOT or not parts[0] or not parts[3]:
        return None
    try:
        role = Role(parts[2])
    except ValueError:
        return None
    return Identity(parts[0], role, parts[3])


def parse_roles(names: Iterable[str], what: str) -> frozenset[Role]:
    """The roles `names` spell; ConfigError naming `what` and the valid names otherwise."""
    roles: set[Role] = set()
    for name in names:
        try:
            roles.add(Role(name.strip()))
        except ValueError as err:
            raise ConfigError(f"{what}: unknown role {name!r}; roles are {ROLE_NAMES}") from err
    return frozenset(roles)


RANKER_SERVICE = f"/{service_names.RANKER}/"
ROUTER_SERVICE = f"/{service_names.ROUTER}/"
TRIGGER_SERVICE = f"/{service_names.TRIGGER}/"
# Services every server carries that reveal nothing of a user: any authenticated caller.
OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
)
MESH = frozenset({Role.ROUTER, Role.TRIGGER, Role.RANKER})
DEFAULT_ENTRY_CALLERS = frozenset({Role.CLIENT, Role.TRIGGER})


@dataclass(frozen=True, slots=True)
class Policy:
    """Method (full gRPC path) -> the roles allowed to call it; a method absent from `methods`
    is refused to every caller unless it belongs to one of `OPEN_SERVICES` or is in `open`.

    Invariant: a refusal is decided from the method and the caller's role alone, so the check
    on the hot path is one lookup and one membership test.
    """

    methods: Mapping[str, frozenset[Role]]
    open: frozenset[str]

    def is_open(self, method: str) -> bool:
        """Any authenticated caller may call `method` (mutual TLS already checked who)."""
        return method in self.open or method.startswith(OPEN_SERVICES)

    def allowed(self, method: str) -> frozenset[Role]:
        """The roles that may call `method` (every role when it is open)."""
        if self.is_open(method):
            return frozenset(Role)
        return self.methods.get(method, frozenset())

    def permits(self, method: str, role: Role | None) -> bool:
        """Whether a caller of `role` (None: no identity the table knows) may call `method`."""
        if self.is_open(method):
            return True
        return role is not None and role in self.methods.get(method, ())


def mesh_policy(entry_callers: frozenset[Role] = DEFAULT_ENTRY_CALLERS) -> Policy:
    """The service graph's table; `entry_callers` may call the router's and the trigger's
    methods (configurable: `authz_entry_callers`)."""
    rankers = frozenset({Role.RANKER})
    return Policy(
        methods={
            RANKER_SERVICE + "Handoff": rankers,
            RANKER_SERVICE + "Fetch": rankers,
            RANKER_SERVICE + "PreInfer": MESH,
            RANKER_SERVICE + "Rank": MESH,
            ROUTER_SERVICE + "PreInfer": entry_callers,
            ROUTER_SERVICE + "Rank": entry_callers,
            TRIGGER_SERVICE + "OnRetrieval": entry_callers,
        },
        open=frozenset({RANKER_SERVICE + "Describe"}),
    )


def refusal(method: str, role: Role | None) -> str:
    """The PERMISSION_DENIED message: the method, the caller's role, and who may call it."""
    who = role.value if role is not None else "no relaygr identity"
    return (
        f"{method} is not allowed for a caller with role {who!r}"
        f" (spiffe://<trust domain>/relaygr/<role>/<instance>); see docs/security.md"
    )


def render_table(policy: Policy, methods: Iterable[str]) -> str:
    """`methods` with the roles allowed to call each, one line a method (docs and --help)."""
    lines = []
    for method in methods:
        if policy.is_open(method):
            who = "any authenticated caller"
        else:
            who = ", ".join(r.value for r in Role if r in policy.allowed(method)) or "nobody"
        lines.append(f"{method:<44} {who}")
    return "\n".join(lines)


@dataclass(slots=True)
class AuthzStats:
    """Refusals by (method, caller role or "none"): read by `/metrics`, never reset."""

    refused: dict[tuple[str, str], int] = field(default_factory=dict)

    def count(self, method: str, role: Role | None) -> None:
        key = (method, role.value if role is not None else "none")
        self.refused[key] = self.refused.get(key, 0) + 1


@dataclass(slots=True)
class Throttle:
    """At most one report per key per `interval_s` (on the clock the caller passes): `admit`
    returns how many were held back since the last report when one is due, None otherwise."""

    interval_s: float
    _last: dict[object, float] = field(default_factory=dict)
    _held: dict[object, int] = field(default_factory=dict)

    def admit(self, key: object, now: float) -> int | None:
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


def table_methods(policy: Policy) -> list[str]:
    """The methods named by `policy`, in a stable order (then the open services)."""
    named = sorted(set(policy.methods) | policy.open)
    return [*named, *(prefix + "*" for prefix in OPEN_SERVICES)]


def authz_help(policy: Policy | None = None) -> str:
    """The `--help` epilog of every service: who may call what under mutual TLS."""
    policy = policy or mesh_policy()
    return (
        "Who may call what (mutual TLS with authz on; each caller's role is named by its\n"
        "certificate, spiffe://<trust_domain>/relaygr/<role>/<instance>; the router's and\n"
        "the trigger's methods take authz_entry_callers; docs/security.md):\n"
        + render_table(policy, table_methods(policy))
    )
