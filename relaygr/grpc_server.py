"""Shared gRPC plumbing: error interceptor, server bootstrap with health and reflection, drain."""

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from relaygr.errors import (
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidInput,
    RelayGRError,
    ResourceExhausted,
    Unavailable,
)
from relaygr.reflection import enable_reflection
from relaygr.service_options import ServerOptions

_log = logging.getLogger(__name__)

# Looked up along the exception's MRO, so subclasses inherit their parent's code.
_STATUS_BY_ERROR: dict[type[RelayGRError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    RelayGRError: grpc.StatusCode.INTERNAL,
}

_HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

UnaryBehaviour = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def status_for(err: RelayGRError) -> grpc.StatusCode:
    """The gRPC status code for one of our errors (INTERNAL unless a subclass says otherwise)."""
    for cls in type(err).__mro__:
        code = _STATUS_BY_ERROR.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def absolute_deadline(time_remaining: float | None, now: float) -> float | None:
    """`context.time_remaining()` as an absolute `time.monotonic()` deadline; None: no deadline.

    `now` is the caller's `time.monotonic()`, passed in so the function stays pure.
    """
    return None if time_remaining is None else now + max(0.0, time_remaining)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps the RelayGRError hierarchy to gRPC status codes for async unary-unary handlers.

    Invariants: a `context.abort` made by the handler keeps its status; CancelledError (RPC
    cancelled, grace expired) propagates untouched; any other exception becomes INTERNAL with a
    short message and a logged traceback, so one bad request never takes the server down.
    Streaming and synchronous handlers pass through unchanged.
    """

    def __init__(self) -> None:
        # method -> (the handler it wrapped, the guarded handler): built once, not per call
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not inspect.iscoroutinefunction(handler.unary_unary):
            return handler
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is None or cached[0] is not handler:
            # The request is decoded inside the guard: gRPC's own decoding would answer a
            # malformed message with UNKNOWN and the parser's internals.
            guarded = grpc.unary_unary_rpc_method_handler(
                _guarded(handler.unary_unary, method, handler.request_deserializer),
                request_deserializer=None,
                response_serializer=handler.response_serializer,
            )
            cached = self._guarded[method] = (handler, guarded)
        return cached[1]


def _guarded(
    behaviour: UnaryBehaviour, method: str, decode: Callable[[bytes], Any] | None = None
) -> UnaryBehaviour:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if decode is not None:
                try:
                    request = decode(request)
                except DecodeError as err:
                    raise InvalidInput(f"malformed request to {method}: {err}") from err
            return await behaviour(request, context)
        except grpc.aio.AbortError:
            raise  # the handler already chose its status
        except RelayGRError as err:
            await context.abort(status_for(err), str(err) or type(err).__name__)
        except Exception as err:
            _log.exception("unhandled error in %s", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(err).__name__})")

    return guarded


class GrpcServer:
    """A started aio server with health and reflection; build it with `start_server`.

    Invariants: health reports NOT_SERVING for "" and every named service until
    `set_serving(True)`; once `stop` (or `enter_graceful_shutdown`) begins, health stays
    NOT_SERVING for good and `set_serving` is ignored.
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        health: health_aio.HealthServicer,
        port: int,
        service_names: Sequence[str],
    ) -> None:
        self._server = server
        self._health = health
        self._port = port
        self._health_names = ("", *service_names)

    @property
    def port(self) -> int:
        """The bound port (the real one when the address asked for port 0)."""
        return self._port

    async def set_serving(self, serving: bool) -> None:
        status = _SERVING if serving else _NOT_SERVING
        for name in self._health_names:
            await self._health.set(name, status)

    async def enter_graceful_shutdown(self) -> None:
        """Mark every service NOT_SERVING for good, so probes and balancers stop sending."""
        await self._health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        """Reject new RPCs and let in-flight ones finish for up to `grace` seconds, then cancel."""
        await self.enter_graceful_shutdown()
        await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


async def start_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    options: ServerOptions | None = None,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    authz: grpc.aio.ServerInterceptor | None = None,
) -> GrpcServer:
    """Start a server on `address` (e.g. "127.0.0.1:0") serving what `register` adds.

    `interceptors` run outside the error interceptor (tracing: the server span sees the status).
    `authz` (`relaygr.authz_grpc.authorizer`: the one authorization check) runs inside them
    and before the error interceptor, so a refused call is traced and its request never decoded.

    `service_names` are the full names (e.g. "relaygr.v1.RankerService") reported by health
    and by reflection (v1 and v1alpha). `credentials` None binds insecure; pass
    `grpc.ssl_server_credentials(...)` for TLS.
    """
    options = options or ServerOptions()
    server = grpc.aio.server(
        interceptors=[*interceptors, *([authz] if authz is not None else []), ErrorInterceptor()],
        options=options.server_args(),
        maximum_concurrent_rpcs=options.max_concurrent_rpcs,
    )
    register(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    enable_reflection(server, (*service_names, _HEALTH_SERVICE))
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as err:
        raise ConfigError(f"cannot bind gRPC address {address!r}: in use or invalid") from err
    if port == 0:
        raise ConfigError(f"cannot bind gRPC address {address!r}: in use or invalid")
    grpc_server = GrpcServer(server, health, port, service_names)
    # Before start: no health check may ever see the servicer's default SERVING for "".
    await grpc_server.set_serving(False)
    await server.start()
    return grpc_server


async def drain(
    server: GrpcServer,
    grace: float,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    linger_s: float = 0.0,
) -> None:
    """Mark NOT_SERVING, serve on for `linger_s`, let the caller stop taking work and finish
    it, then stop the server.

    The linger is for callers that watch health (gRPC client-side health checking,
    `relaygr.balancing.replica_options`): they see NOT_SERVING and send to another replica
    before the server stops. A call that reaches a stopping server before it has been handed
    to a handler ends CANCELLED, not UNAVAILABLE (grpc/grpc#41785), so no caller could retry it.
    """
    await server.enter_graceful_shutdown()
    if linger_s > 0:
        await asyncio.sleep(linger_s)
    if on_drain is not None:
        await on_drain()
    await server.stop(grace)


def install_drain_handlers(
    loop: asyncio.AbstractEventLoop,
    server: GrpcServer,
    grace: float,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    linger_s: float = 0.0,
) -> asyncio.Future[None]:
    """Run `drain` on the first SIGTERM or SIGINT; the returned future resolves when it ends.

    Later signals are ignored: the drain already under way bounds shutdown by `grace`.
    """
    done: asyncio.Future[None] = loop.create_future()
    running: list[asyncio.Task[None]] = []  # holds a strong reference to the drain task

    def finished(task: asyncio.Task[None]) -> None:
        if done.done():
            return
        if task.cancelled():
            done.cancel()
        elif (err := task.exception()) is not None:
            done.set_exception(err)
        else:
            done.set_result(None)

    def on_signal(signum: signal.Signals) -> None:
        if running:
            _log.warning("%s received while draining; ignored", signum.name)
            return
        _log.info("%s received: draining", signum.name)
        running.append(loop.create_task(drain(server, grace, on_drain, linger_s)))
        running[0].add_done_callback(finished)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return done
