"""A transferred entry's header between its domain form (`transfer.EntryHeader`) and the wire
(`relaygr.v1.PrefixHeader`): one translation for the hand-off and the fetch."""

import dataclasses

from relaygr.v1 import ranker_pb2
from services.ranker.transfer import EntryHeader

_FIELDS = tuple(f.name for f in dataclasses.fields(EntryHeader))


def header_to_proto(header: EntryHeader) -> ranker_pb2.PrefixHeader:
    return ranker_pb2.PrefixHeader(**{name: getattr(header, name) for name in _FIELDS})


def header_from_proto(header: ranker_pb2.PrefixHeader) -> EntryHeader:
    return EntryHeader(**{name: getattr(header, name) for name in _FIELDS})
