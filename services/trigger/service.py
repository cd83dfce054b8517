"""TriggerService.OnRetrieval: decide at once, relay admitted prefixes in the background."""

import hashlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Tracer

from relaygr.behaviours import Prefix
from relaygr.cluster import Directory, Membership
from relaygr.errors import InvalidInput
from relaygr.tracing import child_span, current_context
from relaygr.v1 import common_pb2, trigger_pb2, trigger_pb2_grpc
from relaygr.versions import VersionIndexer, VersionPolicy, choose_version
from relaygr.wire import InputLimits, prefix_from_proto
from services.trigger.dispatch import Dispatcher, Failure, Job
from services.trigger.policy import (
    AdmissionPolicy,
    Decision,
    Event,
    Reason,
    Settled,
    fallback_order,
)

_REASON = {
    reason: trigger_pb2.AdmissionReason.Value(f"ADMISSION_REASON_{reason.name}")
    for reason in Reason
}


@dataclass(slots=True)
class TriggerStats:
    """The trigger's tallies: `decisions` answered, by reason (after a dropped dispatch turned
    ADMITTED into LOAD_LIMIT); admitted relays by outcome: `relayed` (resident on a ranker),
    `refused` (no room), `dispatch_failed` (any other error), `dispatch_dropped` (the dispatch
    queue was full); `landed_elsewhere`: relayed ones the router placed on another ranker than
    the one the trigger found room on; `versions`: decisions by the model version chosen for
    the user (none counted when no live ranker serves the version asked for: NO_RANKER)."""

    decisions: Counter[Reason] = field(default_factory=Counter)
    versions: Counter[str] = field(default_factory=Counter)
    relayed: int = 0
    landed_elsewhere: int = 0
    refused: int = 0
    dispatch_failed: int = 0
    dispatch_dropped: int = 0


class TriggerServicer(trigger_pb2_grpc.TriggerServiceServicer):
    """Validates a retrieval event, asks the policy, queues an admitted relay, answers.

    OnRetrieval does no I/O: the membership and directory are local watched views and the
    PreInfer goes through `dispatcher`. The event's model version is chosen as the router
    chooses it (`relaygr.versions.choose_version` under the live policy in `versions`);
    admission then judges that version's rankers only, and the relay's PreInfer names the
    version, so the router cannot send it to another. An admitted relay the dispatch queue
    cannot take is answered LOAD_LIMIT and counted in `stats.dispatch_dropped`; `stats` also
    tallies decisions by reason and version, and dispatch outcomes.
    """

    def __init__(
        self,
        policy: AdmissionPolicy,
        membership: Membership,
        directory: Directory,
        dispatcher: Dispatcher,
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
    ) -> None:
        """`tracer` (None: off) traces each decision as a `trigger.decide` span, under which
        an admitted relay's PreInfer is sent."""
        self._tracer = tracer
        self.policy = policy
        cfg = policy.cfg  # input limits are startup settings, never changed live
        self._lengths = InputLimits(
            cfg.max_user_features, cfg.max_user_features + cfg.max_long_term, cfg.max_candidates
        )
        self._membership = membership
        self._directory = directory
        self._dispatcher = dispatcher
        self._clock = clock
        self.stats = TriggerStats()
        self.versions = VersionPolicy()
        self._index = VersionIndexer()

    def use_versions(self, policy: VersionPolicy) -> None:
        """Choose versions by `policy` from now on (live config)."""
        self.versions = policy

    async def OnRetrieval(
        self, request: trigger_pb2.RetrievalEvent, context: grpc.aio.ServicerContext
    ) -> trigger_pb2.TriggerDecision:
        view = self._membership.view()
        user = request.user_id
        index = self._index(view)
        version = choose_version(user, request.model_version, self.versions, index.live)
        event = self._event(request, version or "")
        with child_span(self._tracer, "trigger.decide") as span:
            now = self._clock()
            # No live ranker of the version: an empty order (NO_RANKER).
            order = [] if version is None else fallback_order(user, version, index, self._directory)
            decision = self.policy.decide(event, order, now)
            if decision.admitted and not self._dispatch(request, decision, now):
                self.stats.dispatch_dropped += 1
                decision = self.policy.dropped(decision, user)
            if span is not None:
                span.set_attributes(
                    {
                        "relaygr.user_id": request.user_id,
                        "relaygr.model_version": decision.model_version,
                        "relaygr.admission.reason": decision.reason.value,
                        "relaygr.admission.admitted": decision.admitted,
                        "relaygr.admission.predicted_full_ms": decision.predicted_full_ms,
                        "relaygr.admission.target": decision.target,
                        "relaygr.tokens.prefix": event.prefix_tokens,
                        "relaygr.kv.bytes": decision.kv_bytes,
                        "relaygr.admission.prefill_ms": decision.prefill_ms,
                        "relaygr.relay.window_ms": decision.relay_window_ms,
                    }
                )
        self.stats.decisions[decision.reason] += 1
        if version is not None:
            self.stats.versions[version] += 1
        return trigger_pb2.TriggerDecision(
            request_id=request.request_id,
            admitted=decision.admitted,
            reason=_REASON[decision.reason],
            predicted_full_ms=decision.predicted_full_ms,
            target_instance=decision.target if decision.admitted else "",
            prefix_digest=decision.digest,
            model_version=decision.model_version,
        )

    def _event(self, request: trigger_pb2.RetrievalEvent, model_version: str) -> Event:
        """The policy's view of a valid event for `model_version`; InvalidInput names what is
        wrong."""
        cfg = self.policy.cfg  # input limits are startup settings, never changed live
        if not request.user_id:
            raise InvalidInput("user_id must not be empty")
        limits = (
            ("long-term behaviours", len(request.long_term.item_ids), cfg.max_long_term),
            ("expected_short_term", request.expected_short_term, cfg.max_short_term),
            ("expected_candidates", request.expected_candidates, cfg.max_candidates),
        )
        for what, count, limit in limits:
            if count > limit:
                raise InvalidInput(f"{count} {what} exceed the limit of {limit}")
        prefix = prefix_from_proto(request, self._lengths)  # ids, array lengths, ragged arrays
        return Event(
            request.user_id,
            prefix.num_tokens,
            request.expected_short_term,
            request.expected_candidates,
            lambda: fingerprint(prefix),
            model_version,
        )

    def _dispatch(
        self, request: trigger_pb2.RetrievalEvent, decision: Decision, now: float
    ) -> bool:
        """Queue the relay; sequence-aware, it asks the router for the ranker with room."""
        cfg = self.policy.cfg
        preferred = self.policy.preferred(decision)
        due_at = now + cfg.expected_gap_ms / 1e3
        context = current_context(self._tracer)
        job = Job(decision, request, cfg.relay_window_ms, context, preferred, due_at)
        return self._dispatcher.submit(job)

    def on_outcome(
        self, job: Job, reply: common_pb2.PreInferReply | None, failure: Failure | None
    ) -> None:
        """Book a finished dispatch: a relay now resident, refused for room, or failed.

        A relay that landed elsewhere than the ranker the trigger found room on was refused
        there (or that ranker was down): it is full until observed otherwise.
        """
        landed = None if reply is None else (reply.instance_id, reply.kv_bytes)
        refused = failure is not None and _refused_for_room(failure)
        settled = self.policy.settle(
            job.decision, job.user_id, job.preferred_instance, landed, refused, self._clock()
        )
        if settled in (Settled.RELAYED, Settled.RELAYED_ELSEWHERE):
            self.stats.relayed += 1
        self.stats.landed_elsewhere += settled is Settled.RELAYED_ELSEWHERE
        self.stats.refused += settled is Settled.REFUSED
        self.stats.dispatch_failed += settled is Settled.FAILED


def fingerprint(prefix: Prefix, tail: int = 64) -> str:
    """A cheap identity of a user's prefix: its length, user features and last `tail`
    behaviours (constant time, where a content digest of an 8k history costs ~0.3 ms).

    A history changes by appending, so equal fingerprints mean equal prefixes in practice; a
    false match would only skip a relay, never change a score (rankers key their caches by the
    full content digest).
    """
    h = hashlib.blake2b(digest_size=12, person=b"relaygr-trigger")
    h.update(len(prefix.long_term).to_bytes(8, "little"))
    h.update(prefix.user_features.tobytes())
    h.update(prefix.long_term.slice(-tail).records().tobytes())
    return h.hexdigest()


def _refused_for_room(failure: Failure) -> bool:
    """A ranker (or every ranker, through the router) had no room for the relay."""
    return failure.code is grpc.StatusCode.RESOURCE_EXHAUSTED
