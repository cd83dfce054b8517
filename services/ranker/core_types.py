"""What flows in and out of the ranker core (services/ranker/core.py): the requests as it sees
them, the jobs it schedules (data), the actions it asks of its driver and what it reports."""

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, NewType, Protocol, TypeVar

from relaygr.behaviours import UserId
from relaygr.bucket_counts import BucketCounts
from relaygr.cost import CallShape, CostModel
from services.ranker.chunks import Span, background_chunk, extension_span, prefill_span
from services.ranker.digest import PrefixDigest
from services.ranker.kv_store import Cached, CacheKey, KVStats, Tier, TierUsage
from services.ranker.outcomes import CacheOutcome, Origin, PreInferOutcome, Work
from services.ranker.plan import Held
from services.ranker.queues import Job, Priority

KV = TypeVar("KV", bound=Cached)
RequestId = NewType("RequestId", int)


class PrefixRef(Protocol):
    """A request's prefix as the core sees it: sizes and digests, the content the driver's."""

    @property
    def user_id(self) -> UserId: ...

    @property
    def digest(self) -> PrefixDigest: ...

    @property
    def user_features(self) -> int: ...

    @property
    def behaviours(self) -> int: ...

    def head_digest(self, behaviours: int) -> PrefixDigest:
        """The digest of this prefix cut after its first `behaviours` behaviours."""
        ...


class RankRef(Protocol):
    """A Rank request as the core sees it."""

    @property
    def prefix(self) -> PrefixRef: ...

    @property
    def short_term(self) -> int: ...

    @property
    def candidates(self) -> int: ...


def history_tokens(request: RankRef) -> int:
    return request.prefix.user_features + request.prefix.behaviours + request.short_term


# -- jobs: what to compute (the driver runs each step) -------------------------------------


@dataclass(frozen=True, slots=True)
class Prefill:
    """Compute `prefix` from nothing in `chunk`-token steps (`chunks.prefill_spans`)."""

    prefix: PrefixRef
    chunk: int


@dataclass(frozen=True, slots=True)
class Extend(Generic[KV]):
    """Bring `base` (a cached strict prefix of `prefix`, of `base_behaviours` behaviours) to the
    device, then extend it `chunk` behaviours a step (`chunks.extension_spans`)."""

    prefix: PrefixRef
    base: KV
    base_behaviours: int
    chunk: int


@dataclass(frozen=True, slots=True)
class Reload(Generic[KV]):
    """Bring the host copy `host` back to the device (one step)."""

    host: KV


@dataclass(frozen=True, slots=True)
class Score(Generic[KV]):
    """Score `request`'s candidates against the device-resident prefix `kv` (one step)."""

    request: RankRef
    kv: KV


@dataclass(frozen=True, slots=True)
class FullForward:
    """Full inference of `request`, nothing cached (one step). `keep`: the call also keeps the
    K/V of the request's prefix, its product a `Kept` (a miss computed in one call);
    otherwise its product is the scores alone."""

    request: RankRef
    keep: bool = False


@dataclass(frozen=True, slots=True)
class Kept(Generic[KV]):
    """What a `FullForward` that keeps its prefix makes: the Rank's scores and the prefix."""

    scores: Any
    kv: KV


Spec = Prefill | Extend[Any] | Reload[Any] | Score[Any] | FullForward


def chunk_span(spec: Spec, step: int) -> Span | None:
    """The tokens step `step` of a prefix job computes (cached before it, cached after it), when
    that step is a prefill chunk (`chunks.prefill_spans`, `extension_spans`); None when it is
    not: an extension's first step brings its base over, a reload computes nothing, a scoring
    step is no chunk."""
    if isinstance(spec, Prefill):
        prefix = spec.prefix
        return prefill_span(prefix.user_features, prefix.behaviours, spec.chunk, step)
    if isinstance(spec, Extend) and step > 0:
        prefix = spec.prefix
        return extension_span(
            prefix.user_features, spec.base_behaviours, prefix.behaviours, spec.chunk, step - 1
        )
    return None


def call_shape(spec: Spec, held_of: Callable[[Any], Held], step: int = 0) -> CallShape:
    """A step's share of a model call (`relaygr.cost.CallShape`): a Score computes its
    short-term behaviours on its cached prefix, a full inference its whole history, a prefill
    chunk (step `step` of a Prefill or Extend: `chunk_span`) its chunk on what is cached."""
    if isinstance(spec, Score):
        request = spec.request
        cached = held_of(spec.kv).num_tokens
        return CallShape(cached, request.short_term, request.candidates)
    if isinstance(spec, FullForward):
        request = spec.request
        return CallShape(0, history_tokens(request), request.candidates)
    span = chunk_span(spec, step)
    assert span is not None, "not a model call over tokens"
    before, after = span
    return CallShape(before, after - before, 0)


def call_rows(shape: CallShape) -> int:
    """The rows a request puts through a call's projections and feed-forward layers."""
    return shape.new_tokens + shape.candidates


def work_of(spec: Spec) -> Work:
    if isinstance(spec, Prefill):
        return Work.PREFILL
    if isinstance(spec, Extend):
        return Work.EXTEND
    if isinstance(spec, Reload):
        return Work.RELOAD
    return Work.RANK if isinstance(spec, Score) else Work.FULL_FORWARD


# -- actions: what the driver does -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunStep:
    """Run the next step of `job` (`job.steps_run` steps done, `job.partial` their product) on
    the compute worker; report `step_done` or `step_failed`."""

    job: Job


@dataclass(frozen=True, slots=True)
class RunBatch:
    """Run the next step of each of `jobs` as one model call: two or more scoring jobs of one
    kind, all Score or all FullForward, in rank order (`RankingModel.rank_batch` or
    `full_forward_batch`), or two or more background prefix jobs' prefill chunks (`chunk_span`:
    a Prefill's or an Extend's), in the background queue's order (`chunk_batch`). Report each
    job's own result by `step_done` (the worker is free once every job is reported), or the
    call's failure by `batch_failed`."""

    jobs: tuple[Job, ...]


@dataclass(frozen=True, slots=True)
class StartFetch:
    """Fetch `key` (`nbytes`, `user_tokens` user tokens) from `peers` in turn, giving up at the
    deadline that `RankerCore.fetch_deadline(key)` says then; report `fetch_done`."""

    key: CacheKey
    peers: tuple[Any, ...]
    nbytes: int
    user_tokens: int


@dataclass(frozen=True, slots=True)
class Waited:
    """`request`, which waited for another request's in-flight prefix, stops waiting."""

    request: RequestId


@dataclass(frozen=True, slots=True)
class PreInferAnswer:
    outcome: PreInferOutcome
    key: CacheKey
    tokens: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class RankAnswer:
    outcome: CacheOutcome
    computed_tokens: int
    relayed: bool
    scores: Any  # what the scoring step returned


@dataclass(frozen=True, slots=True)
class Answer:
    """`request` is over: `result`, or `error` (a RelayGRError, or what a step raised)."""

    request: RequestId
    result: PreInferAnswer | RankAnswer | None = None
    error: BaseException | None = None


Action = RunStep | RunBatch | StartFetch | Waited | Answer


# -- observations: what the core reports (tracing, metrics and the cost learner subscribe) ---


class JobEnd(StrEnum):
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class ScoringCall:
    """One scoring model call (cached Ranks' Score steps or full inferences, one or batched):
    its work and its requests' shapes, in call order."""

    work: Work
    shapes: tuple[CallShape, ...]

    @property
    def requests(self) -> int:
        return len(self.shapes)

    @property
    def rows(self) -> int:
        """Rows through the call's projections and feed-forward layers (`call_rows`)."""
        return sum(call_rows(s) for s in self.shapes)


@dataclass(frozen=True, slots=True)
class JobEnded(Generic[KV]):
    """A job ended; a prefix job that ended DONE made `kv` device-resident, `computed_tokens` of
    its tokens computed (0 for a reload). One per computation, however many requests waited.
    A scoring job that ran: `call`, the model call it ran in (alone or batched)."""

    job: Job
    work: Work
    end: JobEnd
    computed_tokens: int = 0
    kv: KV | None = None
    call: ScoringCall | None = None


@dataclass(frozen=True, slots=True)
class Computed:
    """A PREFILL, EXTEND, RANK or FULL_FORWARD job completed after `seconds` of compute (its own
    steps, as the driver timed them); `tokens` of history, `cached_tokens` found cached (None:
    from nothing), `candidates` scored."""

    work: Work
    tokens: int
    cached_tokens: int | None
    candidates: int
    seconds: float


@dataclass(frozen=True, slots=True)
class BatchComputed:
    """A batched scoring `call` (two or more Ranks) completed after `seconds` of compute, the
    whole call's as the driver timed it: one per call, for the cost learner's batch term (its
    Ranks report no `Computed`: the call's time is no one request's alone)."""

    call: ScoringCall
    seconds: float


def computed_of(job: Job, held_of: Callable[[Any], Held]) -> Computed | None:
    """What a finished job computed, for the cost learner (None: a reload computes nothing)."""
    spec, seconds = job.spec, job.seconds
    if isinstance(spec, Prefill | Extend):
        prefix = spec.prefix
        tokens = prefix.user_features + prefix.behaviours
        if isinstance(spec, Prefill):
            return Computed(Work.PREFILL, tokens, None, 0, seconds)
        cached = prefix.user_features + spec.base_behaviours
        return Computed(Work.EXTEND, tokens, cached, 0, seconds)
    if isinstance(spec, Score | FullForward):
        request = spec.request
        history = history_tokens(request)
        if isinstance(spec, Score):
            cached = held_of(spec.kv).num_tokens
            return Computed(Work.RANK, history, cached, request.candidates, seconds)
        return Computed(Work.FULL_FORWARD, history, None, request.candidates, seconds)
    return None


@dataclass(frozen=True, slots=True)
class PreInferServed(Generic[KV]):
    prefix: PrefixRef
    outcome: PreInferOutcome
    kv: KV
    window_s: float


@dataclass(frozen=True, slots=True)
class RankServed:
    """`consumed`: the origin of the prefix cache it used, when another request produced it."""

    request: RankRef
    outcome: CacheOutcome
    computed_tokens: int
    consumed: Origin | None


Observation = JobEnded[Any] | Computed | BatchComputed | PreInferServed[Any] | RankServed


# Bucket bounds of the scoring calls' sizes: requests per call, rows (`call_rows`) per call.
BATCH_REQUEST_BOUNDS: tuple[float, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
BATCH_ROW_BOUNDS: tuple[float, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class CoreStats:
    """What a ranker core holds and has done, as of the last event (reading it changes
    nothing: expiry happens on `RankerCore.tick`); the metrics and Describe read it by attribute."""

    tiers: dict[Tier, TierUsage]
    kv: KVStats  # counters since start
    queue_depth: dict[Priority, int]  # jobs waiting for the worker
    queued_background_ms: float  # predicted compute of background work queued or running
    inflight: int  # prefix computations, reloads and fetches
    cost_model: CostModel  # the one decisions use now
    # Predicted compute of rank work queued or running, batched (`RankerCore.queued_rank_ms`).
    queued_rank_ms: float = 0.0
    # Per scoring model call (a Rank's Score or full inference, batched or alone), since start.
    batch_requests: BucketCounts = field(
        default_factory=lambda: BucketCounts.empty(BATCH_REQUEST_BOUNDS)
    )
    batch_rows: BucketCounts = field(default_factory=lambda: BucketCounts.empty(BATCH_ROW_BOUNDS))
    # Per background chunk call (one user's prefill or extension chunk, or several users'),
    # since start: users in the call, and its new tokens.
    chunk_batch_requests: BucketCounts = field(
        default_factory=lambda: BucketCounts.empty(BATCH_REQUEST_BOUNDS)
    )
    chunk_batch_rows: BucketCounts = field(
        default_factory=lambda: BucketCounts.empty(BATCH_ROW_BOUNDS)
    )
    # The 99th percentile of the latest relays' waits for their Rank, ms (0: too few yet).
    relay_wait_p99_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """The core's settings: `RankerConfig.core_settings()` makes them for every driver."""

    relay_enabled: bool
    relay_window_s: float
    prefill_chunk_tokens: int
    # The most share of a background chunk's predicted time its call's fixed cost may take:
    # the chunk grows past prefill_chunk_tokens, in steps of it and within max_batch_rows,
    # until it does (chunks.background_chunk, from the cost model in use); 1: never grows.
    prefill_chunk_fixed_share: float = 1.0
    max_relay_window_s: float = 60.0  # a longer pin asked for is refused: it would hold memory
    max_queued_ranks: int = 64
    max_queued_prefills: int = 256
    # A scoring call takes at most this many Ranks (a chunk call this many users' background
    # chunks), and this many rows (`call_rows`) unless its first step alone has more; 1: every
    # step its own call.
    max_batch_requests: int = 8
    max_batch_rows: int = 4096
    # Jobs queued in the head's queue (the one taken included) from which a call batches even
    # when a joiner saves less than half its own call (batching.BatchRoom): only a backlog
    # repays the delay a shared call puts on its first steps.
    batch_backlog: int = 4
    # Most new tokens of background chunks in one call (and within max_batch_rows): a Rank
    # arriving meanwhile waits for the whole call.
    max_chunk_batch_rows: int = 512

    def background_chunk(self, cost: CostModel) -> int:
        """The tokens of a background chunk under `cost` (`chunks.background_chunk`)."""
        return background_chunk(
            cost, self.prefill_chunk_tokens, self.prefill_chunk_fixed_share, self.max_batch_rows
        )

    def max_queued(self) -> dict[Priority, int]:
        return {Priority.RANK: self.max_queued_ranks, Priority.BACKGROUND: self.max_queued_prefills}
