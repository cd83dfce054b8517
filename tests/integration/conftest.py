"""Fixtures for the integration tests: a real etcd server, a real OTLP trace receiver."""

from tests.integration.etcd_server import etcd_server  # noqa: F401
from tests.integration.otlp_receiver import otlp_receiver  # noqa: F401
