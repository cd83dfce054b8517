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
    others = [
        instance
        for instance, record in view.items()
        if instance != self_id and record.model_version == model_version
    ]
    order = ranking(user, others)
    return order[0] if order else None
