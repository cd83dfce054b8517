"""The trigger service chooses an event's model version as the router does: a version asked for
is relayed under that version or not at all, never under the current one instead."""

import numpy as np

from relaygr.cluster import MemoryCluster
from relaygr.v1 import common_pb2, trigger_pb2
from relaygr.versions import VersionPolicy
from relaygr.wire import behaviours_to_proto
from services.trigger.config import Mode
from services.trigger.dispatch import Dispatcher
from services.trigger.policy import AdmissionPolicy
from services.trigger.service import TriggerServicer
from tests.unit.ranker.factories import prefix
from tests.unit.trigger.test_policy import config, ranker

CURRENT, OTHER, GONE = "mv-current", "mv-other", "mv-gone"


async def _never(request: common_pb2.PreInferRequest, timeout_s: float) -> common_pb2.PreInferReply:
    raise AssertionError("the dispatcher is not started: nothing is sent")


async def _trigger() -> tuple[TriggerServicer, Dispatcher]:
    """A trigger relaying every event (mode all) over two live versions, CURRENT the policy's."""
    cluster = MemoryCluster()
    for name, version in (("c0", CURRENT), ("c1", CURRENT), ("o0", OTHER)):
        await cluster.register(ranker(name, model_version=version), ttl_s=5)
    dispatcher = Dispatcher(_never, capacity=8, concurrency=1)  # queued, never sent
    trigger = TriggerServicer(AdmissionPolicy(config(mode=Mode.ALL)), cluster, cluster, dispatcher)
    trigger.use_versions(VersionPolicy(current=CURRENT))
    return trigger, dispatcher


def _event(rng: np.random.Generator, user: str, asked: str) -> trigger_pb2.RetrievalEvent:
    p = prefix(rng, 20, user_id=user)
    return trigger_pb2.RetrievalEvent(
        request_id=f"e-{user}", user_id=user, user_features=p.user_features.tolist(),
        long_term=behaviours_to_proto(p.long_term), expected_candidates=8,
        expected_short_term=4, model_version=asked,
    )  # fmt: skip


async def test_a_version_asked_for_is_relayed_under_it_and_none_other(
    rng: np.random.Generator,
) -> None:
    trigger, dispatcher = await _trigger()
    unasked = await trigger.OnRetrieval(_event(rng, "a", ""), None)  # type: ignore[arg-type]
    assert (unasked.admitted, unasked.model_version) == (True, CURRENT)
    assert unasked.target_instance in {"c0", "c1"}
    asked = await trigger.OnRetrieval(_event(rng, "b", OTHER), None)  # type: ignore[arg-type]
    assert (asked.admitted, asked.model_version, asked.target_instance) == (True, OTHER, "o0")
    assert dispatcher.queued() == 2


async def test_a_version_asked_for_that_no_ranker_serves_is_not_relayed_under_another(
    rng: np.random.Generator,
) -> None:
    trigger, dispatcher = await _trigger()
    decision = await trigger.OnRetrieval(_event(rng, "c", GONE), None)  # type: ignore[arg-type]
    assert not decision.admitted
    assert decision.reason == trigger_pb2.ADMISSION_REASON_NO_RANKER
    assert (decision.model_version, decision.target_instance) == ("", "")
    assert dispatcher.queued() == 0  # no PreInfer under any version
    assert dict(trigger.stats.versions) == {}  # and none counted as chosen
