"""The router's forwarding engine: route a request, call rankers in turn (retry, hedge), keep books.

No transport and no tracing here: the calls to rankers are injected (`Connect`), their failures
come back as values (`CallFailed`), and a request ends `Served` or `Refused` with a status the
servicer turns into the gRPC answer.
"""

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from relaygr.cluster import Directory, Membership, PlacementRecord
from relaygr.errors import Unavailable
from relaygr.placement import (
    Reason,
    directory_write,
    place,
    route_rank,
    shuffled,
    with_room,
)
from relaygr.room import RelayRoom
from relaygr.versions import (
    VersionIndexer,
    VersionPolicy,
    choose_version,
    unavailable_message,
)
from services.router.attempts import Attempts, Call
from services.router.load import WindowedLoad
from services.router.routes import (
    NO_RANKER,
    TRY_NEXT,
    CallFailed,
    Connect,
    Method,
    RankRoute,
    Refused,
    Route,
    Served,
    Status,
)

_log = logging.getLogger("services.router")

# How many rankers with relay room a PreInfer's route looks for down its order (see `route`).
ROOM_SCAN = 2


@dataclass(frozen=True, slots=True)
class ForwardSettings:
    """The router's forwarding settings (`RouterConfig.forward_settings` builds them).

    `load_epsilon` and `load_floor` bound a ranker's load (`relaygr.placement.load_bound`);
    `relay_window_s` is the load window and a directory entry's lifetime; `rank_hedge_s` (None:
    never) sends a Rank unanswered that long to the next ranker too; `random_placement` turns
    affinity off (the ablation: PreInfer and Rank each go to a ranker drawn at random).
    """

    load_epsilon: float
    load_floor: float
    relay_window_s: float
    rank_hedge_s: float | None = None
    random_placement: bool = False
    # With a relay room view: a ranker that refused a PreInfer for room is tried last until it
    # reports room again, or this long.
    refusal_s: float = 1.0


@dataclass(frozen=True, slots=True)
class RelayHint:
    """What a PreInfer says about where it should land: the ranker the sender found room on
    (`preferred`, empty: none) and its prefix tokens (what it would pin, per token)."""

    preferred: str = ""
    tokens: int = 0


@dataclass(slots=True)
class RouterStats:
    """What the router did, by typed key; metrics read it by attribute.

    `placed`: PreInfers served after affinity placement, by why their first ranker was chosen.
    `rank_routes`: Ranks routed by affinity (served or not), by where their order came from.
    `placed_random`: requests served under random placement, by method.
    `failed_over`: requests served by a ranker after the first one of their route could not.
    `hedged`: Ranks also sent to the next ranker after the hedge delay.
    `forwarded`: every answered call to a ranker by (method, status), failed-over ones included.
    `directory_writes`, `directory_write_failures`: placements written to the directory, and
    those lost to an unreachable store.
    `refused_then_spilled`: PreInfers served by a ranker after an earlier one of their route
    refused them for room (a round trip the room view exists to avoid).
    `versions`: requests routed, by method and the model version chosen for them.
    `version_unavailable`: requests refused because no live ranker serves the version they
    asked for (not by version: a caller could name any number of them).
    """

    placed: Counter[Reason] = field(default_factory=Counter)
    rank_routes: Counter[RankRoute] = field(default_factory=Counter)
    placed_random: Counter[Method] = field(default_factory=Counter)
    failed_over: Counter[Method] = field(default_factory=Counter)
    hedged: Counter[Method] = field(default_factory=Counter)
    forwarded: Counter[tuple[Method, Status]] = field(default_factory=Counter)
    directory_writes: int = 0
    directory_write_failures: int = 0
    refused_then_spilled: int = 0
    versions: Counter[tuple[Method, str]] = field(default_factory=Counter)
    version_unavailable: Counter[Method] = field(default_factory=Counter)


class Forwarder:
    """Places PreInfers by rendezvous hashing with bounded load and sends Ranks after them.

    A request goes `route` -> `forward` -> `settle` (served ones only); `serve` runs all three.
    Routing first chooses the request's model version (`relaygr.versions.choose_version` with
    the policy in `versions`, which live config replaces) and from then on sees only that
    version's rankers: placement, Rank order, hedging and failover never reach a ranker of
    another version, and the directory and room are read and written under that version.
    Routing reads only local views (membership and directory are watched), never the store. A
    placement is written to the directory only when the serving ranker is not the user's hash
    owner and the directory does not already say so for at least half a relay window (see
    `directory_write`), so store writes follow spill-overs and membership changes, not the
    request rate. The load of a ranker is the PreInfers this forwarder placed on it within the
    relay window (`load`).

    With a relay `room` view (filled by a `relaygr.room_poll.RoomPoller` on the same clock), a
    PreInfer goes first to its live `preferred` ranker, else to the first of its order with
    room, trying those the view says are full last; a ranker's refusal for room marks it full,
    and a served PreInfer is booked there until an observation covers it.
    """

    def __init__(
        self,
        settings: ForwardSettings,
        membership: Membership,
        directory: Directory,
        connect: Connect,
        clock: Callable[[], float] = time.time,
        draw: Callable[[int], int] | None = None,
        room: RelayRoom | None = None,
        versions: VersionPolicy | None = None,
    ) -> None:
        """`clock`: wall-clock seconds (directory expiry, load window, `room`). `draw` (an int
        in [0, n) per call; default a fresh `random.Random`) orders rankers under random
        placement. `room` (None: none) is the relay room view PreInfers are placed by.
        `versions` (None: the default policy, the majority version) chooses the version of a
        request that names none."""
        self.settings = settings
        self.room = room
        self._membership = membership
        self._directory = directory
        self._connect = connect
        self._clock = clock
        self._draw = draw if draw is not None else random.Random().randrange
        self.load = WindowedLoad(settings.relay_window_s, clock)
        self.stats = RouterStats()
        self.versions = versions if versions is not None else VersionPolicy()
        self._index = VersionIndexer()

    def use_versions(self, policy: VersionPolicy) -> None:
        """Route by `policy` from now on (live config)."""
        self.versions = policy

    async def serve(
        self,
        method: Method,
        user: str,
        request: bytes,
        time_remaining: Callable[[], float | None] = lambda: None,
        hint: RelayHint | None = None,
        model_version: str = "",
    ) -> Served | Refused:
        """Route, forward and settle one request (what the servicer does around its span)."""
        route = self.route(method, user, hint, model_version)
        if isinstance(route, Refused):
            return route
        outcome = await self.forward(route, request, time_remaining)
        if isinstance(outcome, Served):
            await self.settle(route, outcome)
        return outcome

    def route(
        self, method: Method, user: str, hint: RelayHint | None = None, model_version: str = ""
    ) -> Route | Refused:
        """The rankers to try for `user`'s request, in order; a PreInfer with no live ranker to
        place it on is refused at once (an empty route is refused by `forward`), and so is a
        request for a `model_version` (empty: the policy's choice) no live ranker serves.
        `hint`: what a PreInfer says of where it should land."""
        index = self._index(self._membership.view())
        live = index.live
        version = choose_version(user, model_version, self.versions, live)
        if version is None:
            if not model_version:  # nobody is live: the plain no-ranker answer below
                version = ""
            else:
                self.stats.version_unavailable[method] += 1
                return Refused(Status.UNAVAILABLE, unavailable_message(model_version, live))
        else:
            self.stats.versions[method, version] += 1
        view = index.serving(version)
        if self.settings.random_placement:
            drawn = tuple(shuffled(view, self._draw))
            return Route(method, user, drawn, view, None, model_version=version)
        ids = index.serving_ids(version)
        if method is Method.RANK:
            instance = self._directory.lookup(user, version)
            order = route_rank(user, ids, {} if instance is None else {user: instance})
            reason = RankRoute.DIRECTORY if order and order[0] == instance else RankRoute.HASH
            self.stats.rank_routes[reason] += 1
            return Route(method, user, tuple(order), view, reason, model_version=version)
        entry = self._directory.entry(user, version)
        recorded = {} if entry is None else {user: entry.instance_id}
        s = self.settings
        placement = place(user, ids, self.load.loads(), s.load_epsilon, recorded, s.load_floor)
        if placement is None:
            return Refused(Status.UNAVAILABLE, NO_RANKER)
        hint = hint or RelayHint()
        room, now = self.room, self._clock()
        full: set[str] = set()
        if room is not None:
            # The view is read down the order only until ROOM_SCAN rankers with room: past them
            # the order stays the hash order (a refusal there still moves on: rankers keep the
            # final word), so a PreInfer costs O(ROOM_SCAN + full ones), not O(fleet).
            with_space = 0
            for i in placement.order:
                if room.fits(view[i], hint.tokens * view[i].kv_bytes_per_token, now):
                    with_space += 1
                    if with_space >= ROOM_SCAN:
                        break
                else:
                    full.add(i)
        if full or hint.preferred:
            placement = with_room(placement, hint.preferred, full)
        known = None if entry is None else (entry.instance_id, entry.expires_at)
        return Route(
            method, user, placement.order, view, placement.reason, placement, known, hint.tokens,
            version,
        )  # fmt: skip

    def attempts(self, route: Route) -> Attempts:
        """The calls of one request down `route` (`Attempts`), counted and learnt from here.

        An affinity-routed Rank unanswered for `rank_hedge_s` is also sent to the next ranker
        (once); the first reply wins, so a frozen ranker costs a miss rather than the caller's
        deadline. A ranker's status outside `TRY_NEXT` is the answer at once. When none can
        serve: RESOURCE_EXHAUSTED if every ranker refused for want of room (the request is too
        large or too heavy for all of them), else UNAVAILABLE; the message lists each ranker's
        answer. An empty route is UNAVAILABLE.
        """
        hedge_s = self.settings.rank_hedge_s
        if route.method is not Method.RANK or route.reason is None:
            hedge_s = None
        return Attempts(route, hedge_s, self.answered, self.failed, self._hedged)

    async def forward(
        self,
        route: Route,
        request: bytes,
        time_remaining: Callable[[], float | None] = lambda: None,
    ) -> Served | Refused:
        """Call the rankers of `route` as its `attempts` direct, each call's timeout
        `time_remaining()` (None: none) when it starts; calls still running at the end are
        cancelled."""
        attempts = self.attempts(route)
        step = attempts.start()
        if attempts.hedge_s is None:
            # One call at a time: no task or timer on the common path.
            while isinstance(step, list):
                (call,) = step
                answer = await self._call(route, call, request, time_remaining)
                step = attempts.answered(call.instance, answer)
            return step
        calls: dict[asyncio.Future[bytes | CallFailed], str] = {}
        try:
            while isinstance(step, list):
                for call in step:
                    running = self._call(route, call, request, time_remaining)
                    calls[asyncio.ensure_future(running)] = call.instance
                timeout = attempts.hedge_s if attempts.hedge_armed else None
                done, _ = await asyncio.wait(
                    calls, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:  # the call outlived the hedge delay
                    step = attempts.hedge()
                    continue
                step = []
                for finished in done:
                    outcome = attempts.answered(calls.pop(finished), finished.result())
                    if not isinstance(outcome, list):
                        return outcome
                    step += outcome
        finally:
            for running in calls:
                running.cancel()
        return step

    def _call(
        self,
        route: Route,
        call: Call,
        request: bytes,
        time_remaining: Callable[[], float | None],
    ) -> Awaitable[bytes | CallFailed]:
        ranker = self._connect(route.view[call.instance].address, route.method)
        return ranker(request, time_remaining())

    def _hedged(self, method: Method) -> None:
        self.stats.hedged[method] += 1

    async def settle(self, route: Route, served: Served) -> None:
        """Book a served request (`book`) and write the directory when it must be told."""
        if self.book(route, served):
            await self.record(route.user, served.instance, route.model_version)

    def book(self, route: Route, served: Served) -> bool:
        """Book a served request: its placement's load and count, and the relay on the room
        view. True when the directory must learn where the user went (a PreInfer placed off its
        hash owner and not yet recorded there for half a relay window: `directory_write`)."""
        if route.reason is None:
            self.stats.placed_random[route.method] += 1
            return False
        if route.placement is None:
            return False  # a Rank: counted when routed
        self.load.add(served.instance)
        self.stats.placed[route.placement.reason] += 1
        now = self._clock()
        if self.room is not None:
            nbytes = route.tokens * route.view[served.instance].kv_bytes_per_token
            key = (route.user, route.model_version, route.tokens)
            self.room.landed(key, served.instance, nbytes, now)
        window_s = self.settings.relay_window_s
        return directory_write(served.instance, route.placement.owner, route.known, now, window_s)

    def failed(self, route: Route, instance: str, failed: CallFailed) -> Refused | None:
        """Count a ranker's error, and learn from a refusal for room; the caller's answer
        unless another ranker may serve."""
        self.stats.forwarded[route.method, failed.status] += 1
        no_room = route.method is Method.PRE_INFER and failed.status is Status.RESOURCE_EXHAUSTED
        if no_room and self.room is not None:
            self.room.refuse(instance, self._clock())
        if failed.status in TRY_NEXT:
            return None
        return Refused(failed.status, failed.details or failed.status.value)

    def answered(
        self,
        route: Route,
        reply: bytes,
        instance: str,
        attempts: int,
        failures: Sequence[tuple[str, CallFailed]],
    ) -> Served:
        """Count a reply from `instance` after `attempts` calls that met `failures`."""
        self.stats.forwarded[route.method, Status.OK] += 1
        fallback = instance != route.order[0]
        if fallback:
            self.stats.failed_over[route.method] += 1
        refused = any(f.status is Status.RESOURCE_EXHAUSTED for _, f in failures)
        if route.method is Method.PRE_INFER and refused:
            self.stats.refused_then_spilled += 1
        return Served(reply, instance, attempts, fallback)

    def placement(self, user: str, instance: str, model_version: str) -> PlacementRecord:
        """What the directory is told when the user's cache for `model_version` lives on
        `instance`: that, for a relay window from now."""
        expires_at = self._clock() + self.settings.relay_window_s
        return PlacementRecord(user, instance, expires_at, model_version)

    def recorded(self, written: bool) -> None:
        """Count a directory write the store took (`written`) or had no use for."""
        if written:
            self.stats.directory_writes += 1

    async def record(self, user: str, instance: str, model_version: str) -> None:
        """Tell the directory that the user's cache for `model_version` lives on `instance`
        (for a relay window)."""
        placement = self.placement(user, instance, model_version)
        try:
            self.recorded(await self._directory.record(placement, instance))
        except Unavailable as err:  # the store is down: affinity may degrade, serving goes on
            self.stats.directory_write_failures += 1
            _log.warning("placement of %s on %s not recorded: %s", user, instance, err)
