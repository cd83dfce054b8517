"""The authorization interceptor's check on a call's context: allowed roles pass, others are
aborted PERMISSION_DENIED, counted, and logged at most once per interval per method and role."""

import logging

import grpc
import pytest

from relaygr.authz import Role, mesh_policy
from relaygr.authz_grpc import AuthzInterceptor

FETCH = "/relaygr.v1.RankerService/Fetch"


class Aborted(Exception):
    pass


class Context:
    """What the check reads of a grpc.aio.ServicerContext."""

    def __init__(self, uri: str) -> None:
        self._uri = uri

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"peer_spiffe_id": [self._uri.encode()]} if self._uri else {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_refusals_are_counted_each_and_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    authz = AuthzInterceptor(mesh_policy(), "tooling.local", clock=clock)
    allowed = authz.policy.allowed(FETCH)
    await authz.check(FETCH, allowed, Context("spiffe://tooling.local/relaygr/ranker/r1"))
    client = Context("spiffe://tooling.local/relaygr/client/c")
    caplog.set_level(logging.WARNING, logger="relaygr.authz_grpc")
    for now in (0.0, 1.0, 2.0, 11.0):
        clock.now = now
        with pytest.raises(Aborted) as refused:
            await authz.check(FETCH, allowed, client)
        assert refused.value.args[0] == grpc.StatusCode.PERMISSION_DENIED
        assert "role 'client'" in refused.value.args[1]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "spiffe://tooling.local/relaygr/client/c at ipv4:127.0.0.1:5555" in lines[0]
    assert lines[1].endswith("; 2 more refusals like it not logged")
    assert authz.stats.refused == {(FETCH, "client"): 4}
    with pytest.raises(Aborted):  # another trust domain: no role at all
        await authz.check(FETCH, allowed, Context("spiffe://other.org/relaygr/ranker/r1"))
    assert authz.stats.refused[(FETCH, "none")] == 1
    assert Role.RANKER in allowed
