"""What every service's config turns into for its gRPC server and its client channels."""

import pytest

from relaygr.errors import ConfigError
from services.router.config import RouterConfig


def test_max_connection_age_reaches_the_server_with_the_drain_grace_for_its_calls() -> None:
    aged = RouterConfig(plaintext=True, max_connection_age_s=300, drain_grace_s=7).server_options()
    args = dict(aged.server_args())
    assert args["grpc.max_connection_age_ms"] == 300_000
    assert args["grpc.max_connection_age_grace_ms"] == 7_000
    # Client channels take the message limits only; 0 (the default) never ends a connection.
    assert dict(aged.message_args()).keys() == {
        "grpc.max_receive_message_length",
        "grpc.max_send_message_length",
    }
    default = dict(RouterConfig(plaintext=True).server_options().server_args())
    assert "grpc.max_connection_age_ms" not in default


def test_a_negative_max_connection_age_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="max_connection_age_s"):
        RouterConfig(plaintext=True, max_connection_age_s=-1)
