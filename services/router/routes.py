"""The values a forwarded request is made of: the router's methods, call statuses, a route down
the rankers, and how a request ends. Pure data, shared by the forwarder and its drivers."""

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from relaygr.cluster import RankerRecord
from relaygr.placement import Placement, Reason

NO_RANKER = "no live ranker: none is registered in the membership view"


class Method(enum.StrEnum):
    """The RouterService methods, each forwarded to the RankerService method of the same name."""

    PRE_INFER = "PreInfer"
    RANK = "Rank"


class RankRoute(enum.StrEnum):
    """Where a Rank's order came from: the directory's entry for the user, or the plain hash."""

    DIRECTORY = "directory"
    HASH = "hash"


class Status(enum.StrEnum):
    """A call's status, by gRPC status code name (this module stays free of grpc)."""

    OK = "OK"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"


# A ranker answering these cannot serve this request now; another one can (by full inference
# at worst). Every other status is the caller's answer and passes through unchanged. CANCELLED
# is the ranker's, never the router's own (a call the router gives up raises CancelledError
# instead): a ranker stopping cancels the calls it has not yet handed to a handler
# (grpc/grpc#41785).
TRY_NEXT = frozenset({Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED, Status.CANCELLED})


@dataclass(frozen=True, slots=True)
class CallFailed:
    """A ranker's error answer to one call."""

    status: Status
    details: str | None


# One call to a ranker: (serialized request, timeout in seconds or None) -> the serialized reply,
# or the ranker's error. Any other exception is a bug or a shutdown and propagates.
RankerCall = Callable[[bytes, float | None], Awaitable[bytes | CallFailed]]
# The call of `method` on the ranker at an address.
Connect = Callable[[str, Method], RankerCall]


@dataclass(frozen=True, slots=True)
class Route:
    """The rankers a request tries, in `order`, and why the first was chosen.

    `model_version` is the version chosen for the request and `view` that version's rankers
    only: every ranker of `order` serves it. `reason` is None under random placement. A
    PreInfer placed by affinity also carries its `placement` (the owner among it) and `known`,
    the user's directory entry when it was routed as (instance, expires_at), which decide
    whether the directory must be written once served.
    """

    method: Method
    user: str
    order: tuple[str, ...]
    view: Mapping[str, RankerRecord]
    reason: Reason | RankRoute | None
    placement: Placement | None = None
    known: tuple[str, float] | None = None
    tokens: int = 0  # a PreInfer's prefix tokens
    model_version: str = ""


@dataclass(frozen=True, slots=True)
class Served:
    """A ranker's reply: from `instance` after `attempts` calls; `fallback` when it is not the
    first ranker of the route (the prefix cache, if any, was elsewhere)."""

    reply: bytes
    instance: str
    attempts: int
    fallback: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """No ranker served the request: the caller's answer is `status` with `message`."""

    status: Status
    message: str
