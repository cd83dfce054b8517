"""Fixtures for the integration tests: a real etcd server, a real OTLP trace receiver, a private
temporary directory."""

from tests.integration.etcd_server import etcd_server  # noqa: F401
from tests.integration.otlp_receiver import otlp_receiver  # noqa: F401
from tests.integration.process_mesh import private_tempdir  # noqa: F401
