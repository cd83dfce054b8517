"""What the ranker engine reports as it serves (waits, compute, relay links): port and no-op."""

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from relaygr.behaviours import Prefix, RankInput
from relaygr.cost import CallShape
from services.ranker.core_types import ScoringCall
from services.ranker.outcomes import (
    CacheOutcome,
    FetchResult,
    Operation,
    Origin,
    PreInferOutcome,
    Work,
)
from services.ranker.prefix_kv import PrefixKV
from services.ranker.queues import Job


class EngineObserver(Protocol):
    """The engine's hooks, called on its event loop in the context of the request concerned.

    A job hook runs once per job, when it finished, failed or was cancelled; the job's times
    (`submitted_ns`, `started_ns`, `finished_ns`; 0: not reached) say how far it got.
    """

    def origin(self, operation: Operation) -> Origin | None:
        """The current request as the origin of a prefix it stores; None: nothing to link to."""
        ...

    def waiting_inflight(self) -> AbstractContextManager[object]:
        """Held while a request waits for the in-flight computation of its prefix."""
        ...

    def ranked(self, job: Job, work: Work, call: ScoringCall | None) -> None:
        """A scoring job (RANK or FULL_FORWARD) ended; `call`: the model call it ran in, alone
        or batched with other Ranks (None: it never ran)."""
        ...

    def prefix_landed(self, job: Job, work: Work, computed_tokens: int, kv: PrefixKV) -> None:
        """A PREFILL, EXTEND or RELOAD job made `kv` device-resident (`computed_tokens` of its
        tokens were computed: 0 for a reload). One call per computation, however many requests
        waited for it."""
        ...

    def prefix_failed(self, job: Job, work: Work) -> None:
        """A PREFILL, EXTEND or RELOAD job failed or was cancelled."""
        ...

    def pre_infer_served(
        self, prefix: Prefix, outcome: PreInferOutcome, kv: PrefixKV, window_s: float
    ) -> None:
        """A PreInfer left `kv` pinned on the device for `window_s`."""
        ...

    def rank_served(
        self,
        request: RankInput,
        outcome: CacheOutcome,
        computed_tokens: int,
        consumed: Origin | None,
    ) -> None:
        """A Rank scored its candidates; `consumed`: the origin of the prefix cache it used, when
        another request produced it."""
        ...

    def remote_origin(self, traceparent: str) -> Origin | None:
        """The origin a peer sent with a fetched prefix (its producer's W3C traceparent; empty:
        not known), as this observer links to it; None: nothing to link to."""
        ...

    def fetched(
        self,
        peer: str,
        result: FetchResult,
        nbytes: int,
        seconds: float,
        start_ns: int,
        producer: Origin | None,
    ) -> None:
        """One fetch of a prefix from `peer` ended with `result` after `seconds` (from
        `start_ns`, wall clock); a hit brought `nbytes` produced by `producer`."""
        ...

    def demoting(self, kv: PrefixKV) -> AbstractContextManager[object]:
        """Held while an evicted device prefix is copied to host memory."""
        ...

    def computed(
        self, work: Work, tokens: int, cached_tokens: int | None, candidates: int, seconds: float
    ) -> None:
        """A PREFILL, EXTEND, RANK or FULL_FORWARD job completed after `seconds` of compute: the
        sum of its own steps on the worker, queueing and other jobs' steps between them
        excluded. `tokens`: history tokens it covers; `cached_tokens`: those it found cached
        (None: it started from nothing, a prefill or full inference); `candidates`: scored.

        Called on the event loop once the job's last step is back from the compute worker.
        A job any step of which ran in a batched call is not reported here: a scoring batch is
        reported by `batch_computed`, a call of several users' prefill chunks not at all.
        """
        ...

    def batch_computed(self, work: Work, shapes: tuple[CallShape, ...], seconds: float) -> None:
        """A batched scoring call (RANK or FULL_FORWARD) of two or more Ranks, of `shapes` in
        call order, completed after `seconds`: the whole call's compute. Once per call, on the
        event loop, after its last job is back."""
        ...


class ComputeSink(Protocol):
    """Where compute timings go (a ranker's cost learner): `EngineObserver.computed` and
    `batch_computed`, passed on."""

    def computed(
        self, work: Work, tokens: int, cached_tokens: int | None, candidates: int, seconds: float
    ) -> None: ...

    def batch_computed(self, work: Work, shapes: tuple[CallShape, ...], seconds: float) -> None: ...


_NOTHING: nullcontext[None] = nullcontext(None)


class NoopObserver:
    """Observes nothing, allocates nothing: origins are None, so caches carry no origin."""

    def origin(self, operation: Operation) -> Origin | None:
        return None

    def waiting_inflight(self) -> AbstractContextManager[object]:
        return _NOTHING

    def ranked(self, job: Job, work: Work, call: ScoringCall | None) -> None:
        pass

    def prefix_landed(self, job: Job, work: Work, computed_tokens: int, kv: PrefixKV) -> None:
        pass

    def prefix_failed(self, job: Job, work: Work) -> None:
        pass

    def pre_infer_served(
        self, prefix: Prefix, outcome: PreInferOutcome, kv: PrefixKV, window_s: float
    ) -> None:
        pass

    def rank_served(
        self,
        request: RankInput,
        outcome: CacheOutcome,
        computed_tokens: int,
        consumed: Origin | None,
    ) -> None:
        pass

    def remote_origin(self, traceparent: str) -> Origin | None:
        return None

    def fetched(
        self,
        peer: str,
        result: FetchResult,
        nbytes: int,
        seconds: float,
        start_ns: int,
        producer: Origin | None,
    ) -> None:
        pass

    def demoting(self, kv: PrefixKV) -> AbstractContextManager[object]:
        return _NOTHING

    def computed(
        self, work: Work, tokens: int, cached_tokens: int | None, candidates: int, seconds: float
    ) -> None:
        pass

    def batch_computed(self, work: Work, shapes: tuple[CallShape, ...], seconds: float) -> None:
        pass


class TimingObserver(NoopObserver):
    """Observes only compute timings, passing each to `sink` (a ranker's cost learner)."""

    def __init__(self, sink: ComputeSink) -> None:
        self._sink = sink

    def computed(
        self, work: Work, tokens: int, cached_tokens: int | None, candidates: int, seconds: float
    ) -> None:
        self._sink.computed(work, tokens, cached_tokens, candidates, seconds)

    def batch_computed(self, work: Work, shapes: tuple[CallShape, ...], seconds: float) -> None:
        self._sink.batch_computed(work, shapes, seconds)
