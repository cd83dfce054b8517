"""Fixtures for the integration tests: a real etcd server."""

from tests.integration.etcd_server import etcd_server  # noqa: F401
