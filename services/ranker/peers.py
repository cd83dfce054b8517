"""Which peer ranker a prefix moves to or comes from: pure, over the membership view."""

import math
from collections.abc import Mapping
from typing import NamedTuple

from relaygr.cluster import RankerRecord
from relaygr.placement import ranking
from relaygr.versions import VersionIndexer


def successor(
    user: str, view: Mapping[str, RankerRecord], self_id: str, model_version: str
) -> str | None:
    """The ranker that owns `user` under `model_version` once `self_id` is not in the view.

    Draining, it is who the user's requests go to next (its hand-off target). Missing after a
    placement move, it is who owned the user before `self_id` took it over (its fetch peer):
    rendezvous hashing moves a user only onto a joining ranker, so the rest of the order keeps
    the previous owner first. None when no other ranker serves the version. `view`: a
    membership snapshot (`Membership.view`), never changed in place: its split by version is
    kept while the same object is passed.
    """
    # A rendezvous order without `self_id` is the whole version's order with it left out: rank
    # over the version's rankers (one member set for every ranker, kept by `ranking`).
    mine = _index(view).serving_ids(model_version)
    return next((instance for instance in ranking(user, mine) if instance != self_id), None)


# Views are snapshots (`VersionIndex`): the last one's split serves each ask until it changes.
_index = VersionIndexer()


class PeerAsk(NamedTuple):
    """A peer a miss asks, and whether as the user's owner before this ranker (else as the
    directory's holder)."""

    instance_id: str
    previous_owner: bool


class PreviousOwners:
    """Whether one ranker's misses ask the user's previous owner; both drivers keep one.

    Only a membership change moves a user's owner, so the previous owner is asked within
    `window_s` of the last change (`changed_at`; a ranker's own start counts). A fleet that starts
    together changes too, but nothing is cached anywhere yet: once `cold_asks` asks since the
    change have all found nothing, the ranker stops asking until the next change. Joining a
    fleet that has been serving, an ask soon finds an entry, and then the window runs its course.
    """

    def __init__(self, window_s: float = math.inf, cold_asks: int = 16) -> None:
        self.window_s = window_s
        self.cold_asks = cold_asks
        self._change = -math.inf  # the change the counts below belong to
        self._asked = 0
        self._found = 0

    def asking(self, now: float, changed_at: float) -> bool:
        """Ask previous owners now, the membership last having changed at `changed_at`."""
        if changed_at != self._change:
            self._change, self._asked, self._found = changed_at, 0, 0
        cold = self._found == 0 and self._asked >= self.cold_asks
        return now - changed_at < self.window_s and not cold

    def answered(self, found: bool) -> None:
        """A previous owner answered an ask (a failure or a timeout found nothing)."""
        self._asked += 1
        self._found += found


def fetch_peers(
    user: str,
    model_version: str,
    view: Mapping[str, RankerRecord],
    self_id: str,
    holder: str | None,
    moved: bool,
) -> list[PeerAsk]:
    """Whom a ranker that misses `user`'s prefix asks for it, most likely first: the directory's
    `holder` (where the prefix was placed, when that is another member serving the version),
    then, when the membership changed lately (`moved`), the user's owner before this ranker
    (`successor`). The service's peer source and the simulator both ask here."""
    asks: list[PeerAsk] = []
    record = None if holder is None else view.get(holder)
    if holder is not None and holder != self_id and record is not None:
        asks += [PeerAsk(holder, False)] if record.model_version == model_version else []
    previous = successor(user, view, self_id, model_version) if moved else None
    if previous is not None and previous != holder:
        asks.append(PeerAsk(previous, True))
    return asks
