"""Which keys each role may write in etcd (pure): the table etcd's role-based access is set up
from, by the local mesh and by the chart's setup job.

With `--client-cert-auth` and authentication on, etcd takes the common name of a client's
certificate as its user: `relaygr-<role>`, as `tooling.local.certs` and the chart's
cert-manager examples issue them. Every mesh role reads the whole mesh prefix (views, watches,
live config); rankers write their membership key and directory entries, routers the directory;
nothing else writes (live config is the operator's, as etcd's root).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from relaygr.authz import Role

PREFIX_PLACEHOLDER = "{prefix}/"  # the mesh prefix, in the chart's copy of the commands


class Permission(StrEnum):
    READ = "read"
    READWRITE = "readwrite"


@dataclass(frozen=True, slots=True)
class Grant:
    """`permission` on every key under `<mesh prefix>/<under>`."""

    permission: Permission
    under: str


ETCD_GRANTS: dict[Role, tuple[Grant, ...]] = {
    Role.RANKER: (
        Grant(Permission.READ, ""),
        Grant(Permission.READWRITE, "rankers/"),
        Grant(Permission.READWRITE, "directory/"),
    ),
    Role.ROUTER: (Grant(Permission.READ, ""), Grant(Permission.READWRITE, "directory/")),
    Role.TRIGGER: (Grant(Permission.READ, ""),),
    Role.CLIENT: (),  # no etcd user at all: a client certificate is refused every request
}


def etcd_user(role: Role) -> str:
    """The etcd user (and role) of `role`: the common name of its certificates."""
    return f"relaygr-{role.value}"


def etcdctl_commands(prefix: str) -> list[tuple[str, ...]]:
    """The `etcdctl` argument lists (run as root) that create each role's user and grants for
    the mesh under `prefix`; users have no password (certificate auth only)."""
    base = prefix if prefix == PREFIX_PLACEHOLDER else prefix.rstrip("/") + "/"
    commands: list[tuple[str, ...]] = []
    for role, grants in ETCD_GRANTS.items():
        if not grants:
            continue
        name = etcd_user(role)
        commands.append(("role", "add", name))
        for grant in grants:
            key = base + grant.under
            commands.append(("role", "grant-permission", name, grant.permission.value, key,
                             "--prefix=true"))  # fmt: skip
        commands.append(("user", "add", name, "--no-password"))
        commands.append(("user", "grant-role", name, name))
    return commands


def chart_commands() -> str:
    """`etcdctl_commands` as JSON with `{prefix}/` for the mesh prefix: the chart's setup Job
    runs one etcdctl container per command (helm/relaygr/files/etcd-roles.json, written by
    `python -m relaygr.etcd.roles`; etcd's images have no shell to run a script)."""
    lines = ",\n".join(json.dumps(command) for command in etcdctl_commands(PREFIX_PLACEHOLDER))
    return f"[\n{lines}\n]\n"


if __name__ == "__main__":
    print(chart_commands(), end="")
