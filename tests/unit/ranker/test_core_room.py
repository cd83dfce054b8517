"""RankerCore's relay room: a PreInfer is admitted only if its prefix fits beside the relays
pinned and those still being computed, so no prefill is computed that could not be pinned."""

from relaygr.errors import ResourceExhausted
from services.ranker.core_types import Prefill, PreInferAnswer
from services.ranker.outcomes import PreInferOutcome

from .test_core import R, make, prefix


def test_a_prefix_that_fits_only_beside_pinned_relays_but_not_in_flight_ones_is_refused() -> None:
    # Room for two prefixes: two relays in flight (nothing pinned yet) leave none for a third,
    # refused at once, before any of its compute runs.
    core, d, _ = make(hbm_prefixes=2.5)
    first, second = d.pre_infer(prefix("a")), d.pre_infer(prefix("b"))
    refused = d.answers[d.pre_infer(prefix("c"))].error
    assert isinstance(refused, ResourceExhausted)
    assert "reserved for those in flight" in str(refused)
    assert core.inflight() == 2
    ran = d.run()
    assert all(isinstance(job.spec, Prefill) for job in ran)
    assert {job.spec.prefix.user_id for job in ran} == {"a", "b"}  # nothing of c's
    for rid in (first, second):
        answer = d.result(rid)
        assert isinstance(answer, PreInferAnswer) and answer.outcome is PreInferOutcome.COMPUTED
    # Their Ranks consume them: unpinned, the room is free again.
    d.rank(R(prefix("a")))
    d.rank(R(prefix("b")))
    d.run()
    third = d.pre_infer(prefix("c"))
    d.run()
    assert d.result(third) == PreInferAnswer(
        PreInferOutcome.COMPUTED, core.key(prefix("c")), 104, 104 * 100
    )


def test_a_relay_a_rank_took_over_no_longer_holds_room() -> None:
    # The Rank computes the prefix itself in one call, unpinned: the relay's reserved room is
    # released at once, and a new PreInfer fits.
    core, d, _ = make(hbm_prefixes=1.5)
    d.pre_infer(prefix("a"))
    assert isinstance(d.answers[d.pre_infer(prefix("b"))].error, ResourceExhausted)
    d.rank(R(prefix("a")))
    assert core.flights[core.key(prefix("a"))].taken_over
    admitted = d.pre_infer(prefix("b"))
    assert admitted not in d.answers and core.inflight() == 2
