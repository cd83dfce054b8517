"""How many CPUs this process may use: the least of its cgroup CPU quota and its affinity mask.

`os.cpu_count()` counts the machine's CPUs, not this process's share: a container limited to two
CPUs on a 64-core node would run 64 compute threads that the kernel then throttles. The quota is
read from cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`), in the
process's own cgroup and each ancestor up to the hierarchy's mount (a parent's limit binds its
children too); a hybrid host has both hierarchies and the least limit wins.
"""

import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

_CGROUP_MOUNT = Path("sys/fs/cgroup")
_PROC_SELF_CGROUP = Path("proc/self/cgroup")
# Where the v1 cpu controller is mounted, by distribution: combined with cpuacct, or alone.
_V1_CPU_MOUNTS = ("cpu,cpuacct", "cpu")


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 `cpu.max` ("<quota> <period>" in microseconds, or "max ...").

    None: no limit. Raises ValueError on anything else.
    """
    fields = text.split()
    if not fields or len(fields) > 2:
        raise ValueError(f"cpu.max: expected '<quota|max> [period]', got {text!r}")
    if fields[0] == "max":
        return None
    quota = int(fields[0])
    period = int(fields[1]) if len(fields) == 2 else 100_000  # the kernel's default period
    if quota <= 0 or period <= 0:
        raise ValueError(f"cpu.max: quota and period must be positive, got {text!r}")
    return quota / period


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """CPUs allowed by cgroup v1 `cpu.cfs_quota_us` and `cpu.cfs_period_us`.

    None: no limit (a quota of -1). Raises ValueError on anything else.
    """
    quota, period = int(quota_text.strip()), int(period_text.strip())
    if quota < 0:
        return None
    if quota == 0 or period <= 0:
        raise ValueError(f"cfs quota {quota} / period {period}: expected positive values")
    return quota / period


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """This process's cgroup paths from `/proc/self/cgroup`: (v2 path, v1 cpu controller path).

    Lines are `<id>:<controllers>:<path>`; v2 is the line with id 0 and no controllers.
    """
    v2: str | None = None
    v1_cpu: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1_cpu = path
    return v2, v1_cpu


def _own_then_ancestors(mount: Path, path: str | None) -> Iterator[Path]:
    """The process's cgroup directory under `mount`, then each parent up to `mount` itself.

    Inside a container the mount is often the container's own cgroup while `/proc/self/cgroup`
    shows the host's path, which then does not exist under the mount: start at the mount.
    """
    own = mount / path.lstrip("/") if path else mount
    if not own.is_dir():
        own = mount
    yield own
    while own != mount and mount in own.parents:
        own = own.parent
        yield own


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _least(limits: Iterable[float | None]) -> float | None:
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _v2_limits(mount: Path, path: str | None) -> Iterator[float | None]:
    for directory in _own_then_ancestors(mount, path):
        text = _read(directory / "cpu.max")
        if text is not None:
            try:
                yield parse_cpu_max(text)
            except ValueError:
                continue  # an unreadable limit is no limit; the affinity still bounds it


def _v1_limits(mount: Path, path: str | None) -> Iterator[float | None]:
    for directory in _own_then_ancestors(mount, path):
        quota = _read(directory / "cpu.cfs_quota_us")
        period = _read(directory / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            try:
                yield parse_cfs_quota(quota, period)
            except ValueError:
                continue


def cgroup_cpu_limit(root: Path = Path("/")) -> float | None:
    """The least CPU quota (in CPUs, possibly fractional) over the cgroup v2 and v1 hierarchies
    of this process under filesystem `root`; None when no hierarchy sets one."""
    v2_path, v1_path = parse_proc_cgroup(_read(root / _PROC_SELF_CGROUP) or "")
    mount = root / _CGROUP_MOUNT
    # Pure v2 mounts the unified hierarchy at /sys/fs/cgroup; hybrid hosts at .../unified.
    v2_mount = mount if (mount / "cgroup.controllers").is_file() else mount / "unified"
    limits: list[float | None] = []
    if v2_mount.is_dir():
        limits.append(_least(_v2_limits(v2_mount, v2_path)))
    v1_mount = next((mount / m for m in _V1_CPU_MOUNTS if (mount / m).is_dir()), None)
    if v1_mount is not None:
        limits.append(_least(_v1_limits(v1_mount, v1_path)))
    return _least(limits)


def affinity_cpus() -> int:
    """CPUs this process may be scheduled on (its affinity mask; all CPUs where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # no affinity masks on this platform (macOS)


def available_cpus(root: Path = Path("/"), affinity: int | None = None) -> int:
    """Whole CPUs this process may use: min(cgroup quota rounded down, affinity), at least 1.

    `root` is the filesystem root holding `proc/` and `sys/fs/cgroup/`; `affinity` replaces the
    process's affinity count (both for tests).
    """
    cpus = affinity if affinity is not None else affinity_cpus()
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, math.floor(limit))
    return max(1, cpus)
