"""Measured profiles: a live ranker's published cost model, tier budgets and cache bytes per
token (its Describe), as the simulator's `DeviceProfile` of kind "measured"."""

from collections.abc import Sequence
from datetime import UTC, datetime
from statistics import fmean

from relaygr.cost import CACHED_TERMS, CostModel
from relaygr.errors import InvalidInput
from relaygr.tls import open_blocking_channel
from relaygr.tls_settings import PLAINTEXT, TlsSettings
from relaygr.v1 import ranker_pb2, ranker_pb2_grpc
from tooling.sim.profile import DeviceProfile

# For a normal spread, the median |deviation| is 0.6745 standard deviations.
_MEDIAN_ABS_PER_SD = 0.6745
_MAX_NOISE = 0.5


def profile_of(info: ranker_pb2.RankerInfo, address: str, when: datetime) -> DeviceProfile:
    """The profile `info` (a ranker's Describe at `address`, read at `when`) describes.

    The ranker publishes no request overhead (0 here: the caller measures and sets it) and no
    run-to-run spread: `compute_noise` is taken as the spread of a normal whose median
    |deviation| is the cost fit's median |relative error|, an assumption the profile lists.
    """
    dims, c = info.dims, info.cost_model
    if dims.cache_bytes_per_token == 0:
        raise InvalidInput(f"{address}: Describe has no cache_bytes_per_token (a ranker too old)")
    error = c.median_abs_rel_error
    noise = min(error / _MEDIAN_ABS_PER_SD, _MAX_NOISE)
    return DeviceProfile(
        name=f"measured {info.instance_id}",
        cost=CostModel(
            fixed_ms=c.fixed_ms,
            per_token_ms=c.per_token_ms,
            per_pair_ms=c.per_pair_ms,
            per_candidate_key_ms=c.per_candidate_key_ms,
            reload_ms_per_mb=c.reload_ms_per_mb,
            median_abs_rel_error=error,
            samples=c.samples,
            batch_saving_ms=c.batch_saving_ms,
            batch_samples=c.batch_samples,
            **{term: getattr(c, term) for term in CACHED_TERMS},
        ),
        device_tier_bytes=info.hbm.budget_bytes,
        host_tier_bytes=info.dram.budget_bytes,
        kv_bytes_per_token=dims.cache_bytes_per_token,
        compute_noise=noise,
        kind="measured",
        description=(
            f"{info.device}, {info.intra_op_threads} intra-op thread(s), model "
            f"{info.model_version} ({dims.layers} layers, d_model {dims.d_model}, "
            f"{dims.kv_dtype} cache)"
        ),
        sources=(
            f"Describe of ranker {info.instance_id} at {address}, "
            f"{when.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC: cost model fitted to {c.samples} "
            f"timed runs (median |rel error| {error:.1%})",
        ),
        assumptions=(
            f"compute_noise {noise:.3f}: the fit's median |rel error| {error:.1%} / "
            f"{_MEDIAN_ABS_PER_SD} (a normal spread); the ranker publishes no run-to-run spread",
            "request_overhead_ms: not published by the ranker; measured by the caller, or 0",
        ),
    )


def read_profile(
    address: str, tls: TlsSettings = PLAINTEXT, timeout_s: float = 30.0
) -> DeviceProfile:
    """The measured profile of the ranker at `address`, read now (blocking)."""
    with open_blocking_channel(address, tls) as channel:
        stub = ranker_pb2_grpc.RankerServiceStub(channel)
        info = stub.Describe(ranker_pb2.DescribeRequest(), timeout=timeout_s)
    return profile_of(info, address, datetime.now(UTC))


def mean_profile(profiles: Sequence[DeviceProfile], name: str) -> DeviceProfile:
    """One profile for several rankers of one model (a mesh's): each figure their mean.

    The cost model's coefficients are averaged, so it predicts the mean of the rankers'
    predictions (each is linear in them); `samples` is their sum. Budgets are averaged too
    (a mesh's rankers are normally configured alike); sources and assumptions are kept, each
    once. InvalidInput when none is given or their cache bytes per token differ (not one model).
    """
    if not profiles:
        raise InvalidInput("no profile to average")
    per_token = {p.kv_bytes_per_token for p in profiles}
    if len(per_token) > 1:
        raise InvalidInput(f"profiles of different models: cache bytes per token {per_token}")

    def mean(figure: str) -> float:
        return fmean(getattr(p.cost, figure) for p in profiles)

    return DeviceProfile(
        name=name,
        cost=CostModel(
            fixed_ms=mean("fixed_ms"),
            per_token_ms=mean("per_token_ms"),
            per_pair_ms=mean("per_pair_ms"),
            per_candidate_key_ms=mean("per_candidate_key_ms"),
            reload_ms_per_mb=mean("reload_ms_per_mb"),
            median_abs_rel_error=mean("median_abs_rel_error"),
            samples=sum(p.cost.samples for p in profiles),
            batch_saving_ms=mean("batch_saving_ms"),
            batch_samples=sum(p.cost.batch_samples for p in profiles),
            **{term: mean(term) for term in CACHED_TERMS},
        ),
        device_tier_bytes=round(fmean(p.device_tier_bytes for p in profiles)),
        host_tier_bytes=round(fmean(p.host_tier_bytes for p in profiles)),
        kv_bytes_per_token=per_token.pop(),
        request_overhead_ms=fmean(p.request_overhead_ms for p in profiles),
        compute_noise=fmean(p.compute_noise for p in profiles),
        kind="measured" if all(p.kind == "measured" for p in profiles) else "assumed",
        description=f"the mean of {len(profiles)} rankers: "
        + "; ".join(dict.fromkeys(p.description for p in profiles)),
        sources=tuple(dict.fromkeys(s for p in profiles for s in p.sources)),
        assumptions=tuple(dict.fromkeys(a for p in profiles for a in p.assumptions)),
    )
