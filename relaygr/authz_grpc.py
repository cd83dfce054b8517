"""The one server interceptor that enforces `relaygr.authz`: the verified peer certificate's
identity against the method's allowed roles, PERMISSION_DENIED otherwise (counted, logged
rate-limited). Every service installs it the same way, through `start_server`."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client.metrics_core import Metric

from relaygr.authz import (
    AuthzStats,
    Identity,
    Policy,
    Role,
    Throttle,
    mesh_policy,
    parse_identity,
    refusal,
)
from relaygr.metrics import counter
from relaygr.security import SecurityOptions

_log = logging.getLogger(__name__)
# Where gRPC's TLS puts the peer certificate's SPIFFE ID: its one URI SAN, when that is a
# valid SPIFFE ID (gRPC leaves it out for a certificate with several URIs).
_SPIFFE_KEY = "peer_spiffe_id"
_CACHE_LIMIT = 4096
_LOG_INTERVAL_S = 10.0


class PeerIdentities:
    """The identity a verified peer certificate names: its SPIFFE ID, when `parse_identity`
    accepts it and it is of the expected trust domain; None for anything else.

    Parses are cached by the ID's bytes (peers are few; the cache is cleared if it fills up)."""

    def __init__(self, trust_domain: str) -> None:
        self._trust_domain = trust_domain
        self._cache: dict[bytes, Identity | None] = {}

    def of(self, context: grpc.aio.ServicerContext) -> Identity | None:
        ids = context.auth_context().get(_SPIFFE_KEY)
        if not ids:
            return None
        try:
            return self._cache[ids[0]]
        except KeyError:
            return self._parse(ids[0])

    def _parse(self, san: bytes) -> Identity | None:
        identity = parse_identity(san.decode("utf-8", "replace"))
        if identity is not None and identity.trust_domain != self._trust_domain:
            identity = None
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[san] = identity
        return identity


class AuthzInterceptor(grpc.aio.ServerInterceptor):
    """Refuses each call whose caller's role `policy` does not allow for the method, before
    the handler (or its request decoding) runs; open methods pass through untouched.

    Invariant: the allowed roles of a method are looked up once, when its handler is first
    wrapped; a call costs one auth-context read (cached parse) and one set membership test.
    """

    def __init__(
        self,
        policy: Policy,
        trust_domain: str,
        stats: AuthzStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.stats = stats or AuthzStats()
        self._identities = PeerIdentities(trust_domain)
        self._throttle = Throttle(_LOG_INTERVAL_S)
        self._clock = clock
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or self.policy.is_open(method):
            return handler
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, self._guard(handler, method))
        return cached[1]

    async def check(self, method: str, allowed: frozenset[Role], context: Any) -> None:
        """Return when the caller on `context` holds one of `allowed`; abort the call with
        PERMISSION_DENIED (counted, logged rate-limited) otherwise."""
        identity = self._identities.of(context)
        role = identity.role if identity is not None else None
        if role is not None and role in allowed:
            return
        self.stats.count(method, role)
        held = self._throttle.admit((method, role), self._clock())
        if held is not None:
            _log.warning(
                "refused %s to %s at %s (PERMISSION_DENIED)%s",
                method,
                identity.uri if identity is not None else "a caller with no relaygr identity",
                context.peer(),
                f"; {held} more refusals like it not logged" if held else "",
            )
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal(method, role))

    def _guard(self, handler: Any, method: str) -> grpc.RpcMethodHandler:
        allowed = self.policy.allowed(method)
        check = self.check
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                await check(method, allowed, context)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            stream_in = handler.stream_unary

            async def stream_unary(requests: Any, context: Any) -> Any:
                await check(method, allowed, context)
                return await stream_in(requests, context)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, method, allowed, check),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            _streaming(handler.stream_stream, method, allowed, check),
            handler.request_deserializer,
            handler.response_serializer,
        )


def _streaming(
    behaviour: Callable[..., Any],
    method: str,
    allowed: frozenset[Role],
    check: Callable[[str, frozenset[Role], Any], Awaitable[None]],
) -> Callable[..., Any]:
    """`behaviour` (an async generator, or a coroutine writing through the context) behind the
    check."""
    if inspect.isasyncgenfunction(behaviour):

        async def generated(request: Any, context: Any) -> AsyncIterator[Any]:
            await check(method, allowed, context)
            async for reply in behaviour(request, context):
                yield reply

        return generated

    async def written(request: Any, context: Any) -> Any:
        await check(method, allowed, context)
        return await behaviour(request, context)

    return written


def peer_identity(context: grpc.aio.ServicerContext) -> Identity | None:
    """The relaygr identity the caller's verified certificate names (None: plaintext, or no
    such URI); the trust domain is the interceptor's to check."""
    ids = context.auth_context().get(_SPIFFE_KEY)
    return parse_identity(ids[0].decode("utf-8", "replace")) if ids else None


def authorizer(
    settings: SecurityOptions, stats: AuthzStats | None = None
) -> AuthzInterceptor | None:
    """The interceptor a service with `settings` installs: only under mutual TLS (there is no
    verified identity otherwise) and unless `authz` is off."""
    if settings.plaintext or settings.tls_ca is None or not settings.authz:
        return None
    return AuthzInterceptor(mesh_policy(settings.entry_callers()), settings.trust_domain, stats)


def refusal_metrics(stats: AuthzStats) -> list[Metric]:
    """`relaygr_authz_refused_total{method, role}`: calls refused PERMISSION_DENIED."""
    return [
        counter(
            "relaygr_authz_refused",
            "calls refused PERMISSION_DENIED by authorization, by method and caller role"
            " (none: no relaygr identity)",
            ("method", "role"),
            stats.refused,
        )
    ]
