"""Which etcd failures mean "try another endpoint", and the backoff of the retry loops."""

import asyncio

import aetcd
import aetcd.rpc

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 2.0
# Status codes meaning "this endpoint did not answer", as opposed to "etcd refused the request".
# CANCELLED is what calls in flight get when a failed-over channel is closed under them.
_UNREACHABLE_CODES = frozenset(
    {
        aetcd.rpc.StatusCode.UNAVAILABLE,
        aetcd.rpc.StatusCode.DEADLINE_EXCEEDED,
        aetcd.rpc.StatusCode.CANCELLED,
        # An expired auth token (etcd's simple tokens lapse after --auth-token-ttl idle): a fresh
        # connection authenticates again.
        aetcd.rpc.StatusCode.UNAUTHENTICATED,
    }
)


def unreachable(err: BaseException) -> bool:
    """Whether `err` says the endpoint did not answer (fail over) rather than refused (report)."""
    if isinstance(
        err,
        aetcd.ConnectionFailedError
        | aetcd.ConnectionTimeoutError
        | aetcd.WatchTimeoutError
        | TimeoutError,
    ):
        return True
    rpc_error = err if isinstance(err, aetcd.rpc.AioRpcError) else err.__cause__
    if isinstance(rpc_error, aetcd.rpc.AioRpcError):
        return rpc_error.code() in _UNREACHABLE_CODES
    # e.g. grpc's UsageError for a call started on a channel closed by a failover.
    return isinstance(err, aetcd.rpc.BaseError)


class Backoff:
    """Sleeps 0.1 s, doubling to at most 2 s, until reset: retry loops never spin."""

    def __init__(self) -> None:
        self._delay = _BACKOFF_START_S

    def reset(self) -> None:
        self._delay = _BACKOFF_START_S

    async def sleep(self) -> None:
        await asyncio.sleep(self._delay)
        self._delay = min(self._delay * 2, _BACKOFF_MAX_S)
