"""Which peer ranker a prefix moves to or comes from: pure, over the membership view."""

from collections.abc import Mapping

from relaygr.cluster import RankerRecord
from relaygr.placement import ranking


def successor(
    user: str, view: Mapping[str, RankerRecord], self_id: str, model_version: str
) -> str | None:
    """The ranker that owns `user` under `model_version` once `self_id` is not in the view.

    Draining, it is who the user's requests go to next (its hand-off target). Missing after a
    placement move, it is who owned the user before `self_id` took it over (its fetch peer):
    rendezvous hashing moves a user only onto a joining ranker, so the rest of the order keeps
    the previous owner first. None when no other ranker serves the version.
    """
    # A rendezvous order without `self_id` is the whole version's order with it left out: rank
    # over the version's rankers (one member set for every ranker, kept by `ranking`).
    mine = [instance for instance, record in view.items() if record.model_version == model_version]
    return next((instance for instance in ranking(user, mine) if instance != self_id), None)


def fetch_peers(
    user: str,
    model_version: str,
    view: Mapping[str, RankerRecord],
    self_id: str,
    holder: str | None,
    moved: bool,
) -> list[str]:
    """Whom a ranker that misses `user`'s prefix asks for it, most likely first: the directory's
    `holder` (where the prefix was placed, when that is another member serving the version),
    then, when the membership changed lately (`moved`), the user's owner before this ranker
    (`successor`). The service's peer source and the simulator both ask here."""
    ids: list[str] = []
    record = None if holder is None else view.get(holder)
    if holder is not None and holder != self_id and record is not None:
        ids += [holder] if record.model_version == model_version else []
    previous = successor(user, view, self_id, model_version) if moved else None
    if previous is not None and previous not in ids:
        ids.append(previous)
    return ids
