"""CPU quota detection on fake /proc and /sys/fs/cgroup trees: cgroup v2, v1, hybrid, affinity."""

import os
from pathlib import Path

import pytest

from relaygr.cpu_quota import (
    available_cpus,
    cgroup_cpu_limit,
    parse_cfs_quota,
    parse_cpu_max,
    parse_proc_cgroup,
)

V2_SELF = "0::/kubepods/pod1/ctr\n"
V1_SELF = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(root: Path, proc_cgroup: str = V2_SELF) -> Path:
    """A pure cgroup v2 host; returns the process's own cgroup directory."""
    write(root, "proc/self/cgroup", proc_cgroup)
    write(root, "sys/fs/cgroup/cgroup.controllers", "cpu memory\n")
    own = root / "sys/fs/cgroup/kubepods/pod1/ctr"
    own.mkdir(parents=True)
    return own


def v1_tree(root: Path, quota: str, period: str = "100000") -> Path:
    """A cgroup v1 host with the cpu controller mounted at cpu,cpuacct."""
    write(root, "proc/self/cgroup", V1_SELF)
    own = root / "sys/fs/cgroup/cpu,cpuacct/docker/abc"
    write(own.parent.parent, "cpu.cfs_quota_us", "-1\n")  # the root cgroup: unlimited
    write(own.parent.parent, "cpu.cfs_period_us", "100000\n")
    write(own, "cpu.cfs_quota_us", quota)
    write(own, "cpu.cfs_period_us", period)
    return own


# ---- parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("200000 100000\n", 2.0),
        ("150000 100000\n", 1.5),
        ("50000 100000", 0.5),
        ("max 100000\n", None),
        ("max\n", None),
        ("300000\n", 3.0),  # period left out: the kernel's 100 ms
    ],
)
def test_cpu_max(text: str, cpus: float | None) -> None:
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize("text", ["", "lots 100000", "0 100000", "100000 0", "1 2 3"])
def test_malformed_cpu_max_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_max(text)


@pytest.mark.parametrize(
    ("quota", "period", "cpus"),
    [("400000\n", "100000\n", 4.0), ("25000", "50000", 0.5), ("-1\n", "100000\n", None)],
)
def test_cfs_quota(quota: str, period: str, cpus: float | None) -> None:
    assert parse_cfs_quota(quota, period) == cpus


@pytest.mark.parametrize(("quota", "period"), [("0", "100000"), ("100000", "0"), ("x", "1")])
def test_malformed_cfs_quota_is_refused(quota: str, period: str) -> None:
    with pytest.raises(ValueError):
        parse_cfs_quota(quota, period)


def test_proc_cgroup_paths() -> None:
    assert parse_proc_cgroup(V2_SELF) == ("/kubepods/pod1/ctr", None)
    assert parse_proc_cgroup(V1_SELF) == ("/", "/docker/abc")
    assert parse_proc_cgroup("2:cpuacct:/a\n1:cpu:/b\n") == (None, "/b")  # separate mounts
    assert parse_proc_cgroup("") == (None, None)


# ---- the process's limit on a filesystem tree ---------------------------------------------


def test_v2_limited(tmp_path: Path) -> None:
    own = v2_tree(tmp_path)
    write(own, "cpu.max", "250000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.5
    assert available_cpus(tmp_path, affinity=16) == 2  # rounded down


def test_v2_max_is_unlimited(tmp_path: Path) -> None:
    own = v2_tree(tmp_path)
    write(own, "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    assert available_cpus(tmp_path, affinity=16) == 16


def test_v2_parent_limit_binds_its_children(tmp_path: Path) -> None:
    own = v2_tree(tmp_path)
    write(own, "cpu.max", "max 100000\n")
    write(own.parent, "cpu.max", "300000 100000\n")  # the pod's limit
    write(own.parent.parent, "cpu.max", "800000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 3.0


def test_v2_in_a_cgroup_namespace_reads_the_mount(tmp_path: Path) -> None:
    """The container sees its own cgroup at the mount and `0::/` in /proc/self/cgroup."""
    v2_tree(tmp_path, proc_cgroup="0::/\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "100000 100000\n")
    assert available_cpus(tmp_path, affinity=8) == 1


def test_v1_limited(tmp_path: Path) -> None:
    v1_tree(tmp_path, "300000\n")
    assert cgroup_cpu_limit(tmp_path) == 3.0
    assert available_cpus(tmp_path, affinity=64) == 3


def test_v1_unlimited(tmp_path: Path) -> None:
    v1_tree(tmp_path, "-1\n")
    assert cgroup_cpu_limit(tmp_path) is None
    assert available_cpus(tmp_path, affinity=6) == 6


def test_v1_host_path_missing_under_the_mount_reads_the_mount(tmp_path: Path) -> None:
    """Docker without a cgroup namespace: /proc shows /docker/<id>, the mount is the container's."""
    write(tmp_path, "proc/self/cgroup", V1_SELF)
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "200000\n")
    write(tmp_path, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.0


def test_hybrid_host_takes_the_least_of_v1_and_v2(tmp_path: Path) -> None:
    v1_tree(tmp_path, "500000\n")
    write(tmp_path, "sys/fs/cgroup/unified/cpu.max", "200000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.0


def test_affinity_smaller_than_the_quota_wins(tmp_path: Path) -> None:
    own = v2_tree(tmp_path)
    write(own, "cpu.max", "800000 100000\n")
    assert available_cpus(tmp_path, affinity=3) == 3


@pytest.mark.parametrize("quota", ["50000 100000\n", "1000 100000\n"])
def test_at_least_one_cpu(tmp_path: Path, quota: str) -> None:
    own = v2_tree(tmp_path)
    write(own, "cpu.max", quota)
    assert cgroup_cpu_limit(tmp_path) == pytest.approx(int(quota.split()[0]) / 100000)
    assert available_cpus(tmp_path, affinity=4) == 1


def test_no_cgroup_files_leaves_the_affinity(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None
    assert available_cpus(tmp_path, affinity=5) == 5


def test_malformed_limit_is_ignored_not_fatal(tmp_path: Path) -> None:
    own = v2_tree(tmp_path)
    write(own, "cpu.max", "garbage\n")
    write(own.parent, "cpu.max", "200000 100000\n")
    assert available_cpus(tmp_path, affinity=8) == 2


def test_this_process_gets_at_least_one_and_at_most_its_affinity() -> None:
    cpus = available_cpus()
    assert 1 <= cpus <= len(os.sched_getaffinity(0))
