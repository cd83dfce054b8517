"""Hand-off on drain, receiving side: one stream's entries checked and admitted, unpinned.

Pure of transport: the servicer feeds it headers and data pieces as they arrive.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from relaygr.behaviours import UserId
from services.ranker.handoff import HandoffStats
from services.ranker.handoff_order import Declined, PrefixHolder
from services.ranker.model_config import ModelConfig
from services.ranker.observer import Origin
from services.ranker.prefix_kv import ModelVersion, PrefixKV
from services.ranker.transfer import EntryHeader, Receiver, Refusal

MAX_REFUSALS_LISTED = 8  # HandoffReply.refusals: "at most a few"


@dataclass(slots=True)
class IntakeReport:
    """What one stream brought: the reply's counts and the users whose prefixes were admitted."""

    admitted: int = 0
    refused: int = 0
    admitted_bytes: int = 0
    refusals: list[str] = field(default_factory=list)
    users: list[UserId] = field(default_factory=list)


class HandoffIntake:
    """Receives one Handoff stream, entry by entry (a header, then its data pieces).

    Invariants: at most one entry's payload is buffered (`transfer.Receiver`, bounded by one
    prefix of this model); an entry is admitted only once every check passed, unpinned, by
    `KVStore.put_received` (within budgets, displacing only entries idle since the stream
    began); an entry whose key is held here is counted admitted and not stored twice; an entry
    is refused, never stored, when this ranker holds another prefix of the user (its own is
    kept: it may be newer, and two would only compete) or is computing that prefix itself. An
    entry cut short by the end of the stream is refused as corrupt.
    """

    def __init__(
        self,
        holder: PrefixHolder[PrefixKV],
        cfg: ModelConfig,
        model_version: ModelVersion,
        device: torch.device,
        stats: HandoffStats,
        origin_of: Callable[[str], Origin | None] = lambda _: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._holder = holder
        self._receiver = Receiver(cfg, model_version, device)
        self._header_refused = False  # the current entry was refused (and counted) at its header
        self._stray = False  # data came with no entry to belong to (counted once per run)
        self._stats = stats
        self._origin_of = origin_of
        self._clock = clock
        self._started = clock()
        self._mark = holder.use_mark()
        self.report = IntakeReport()
        stats.received_streams += 1

    def header(self, header: EntryHeader) -> None:
        if self._receiver.header is not None:
            self._finish()  # the previous entry is complete once the next one starts
        refused = self._receiver.start(header)
        self._header_refused, self._stray = refused is not None, False
        if refused is not None:
            self._refuse(header, refused)

    def data(self, data: bytes) -> None:
        if self._receiver.header is None:
            if not self._stray:
                self._stray = True
                self._refuse(None, Refusal.MALFORMED, len(data))
            return
        self._receiver.add(data)  # a refusal is kept by the receiver and counted at finish

    def end(self) -> IntakeReport:
        """The stream ended: finish the last entry and report."""
        if self._receiver.header is not None:
            self._finish()
        self._stats.receive_seconds += self._clock() - self._started
        return self.report

    def abandon(self) -> None:
        """The stream broke (the sender died, the call was cancelled): a partial entry is
        dropped, and counted as corrupt (truncated)."""
        header = self._receiver.header
        if header is not None:
            self._receiver.finish()
            if not self._header_refused:
                self._refuse(header, Refusal.CORRUPT)
        self._stats.receive_seconds += self._clock() - self._started

    def _finish(self) -> None:
        header = self._receiver.header
        assert header is not None
        got = self._receiver.finish()
        if isinstance(got, Refusal):
            if not self._header_refused:  # a header refusal was counted when it came
                self._refuse(header, got)
            return
        key = header.key
        origin = self._origin_of(header.origin_traceparent)
        tier = self._holder.receive(key, got, origin, self._mark)
        if isinstance(tier, Declined):
            self._refuse(header, Refusal(tier.value))
            return
        self.report.admitted += 1
        self.report.admitted_bytes += header.nbytes
        self.report.users.append(key.user_id)
        self._stats.admitted[tier] += 1
        self._stats.admitted_bytes[tier] += header.nbytes

    def _refuse(self, header: EntryHeader | None, why: Refusal, nbytes: int | None = None) -> None:
        size = nbytes if nbytes is not None else (header.nbytes if header is not None else 0)
        self.report.refused += 1
        self._stats.refused[why] += 1
        self._stats.refused_bytes[why] += size
        if len(self.report.refusals) < MAX_REFUSALS_LISTED:
            who = header.user_id if header is not None else "?"
            self.report.refusals.append(f"{who}: {why.value}")
