"""A simulated benchmark: variants x rates x seeds through fresh fleets, summed as the real
benchmark sums its runs (`tooling.local.drive.Point`), with what sizing needs besides."""

import dataclasses
import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.trigger.config import Mode
from tooling.local.compliance import max_compliant
from tooling.local.drive import HIT_OUTCOMES, OK, Point, RequestRecord
from tooling.local.workload import WorkloadSpec
from tooling.sim.events import EventLoop, collector_paused
from tooling.sim.fleet import Fleet, FleetSettings
from tooling.sim.membership import FleetEvent, schedule
from tooling.sim.processes import Processes
from tooling.sim.profile import DeviceProfile
from tooling.sim.ranker import MemoryUse
from tooling.sim.workload import Visit, light_visits

# label -> (trigger mode, rankers serve from caches): the measurement benchmark's variants.
VARIANTS: dict[str, tuple[Mode, bool]] = {
    "no cache": (Mode.OFF, False),
    "cache only": (Mode.OFF, True),
    "relay all": (Mode.ALL, True),
    "relay sequence-aware": (Mode.SEQUENCE_AWARE, True),
}
BASELINES = ("no cache", "cache only")
RELAYS = ("relay all", "relay sequence-aware")


@dataclass(frozen=True, slots=True)
class SweepSpec:
    """What to simulate. With `trace`, every point replays it (its own rate); without, each
    rate draws `duration_s` of the generator's visits per seed."""

    profile: DeviceProfile
    fleet: FleetSettings
    workload: WorkloadSpec
    rates: tuple[float, ...]
    duration_s: float
    seeds: tuple[int, ...]
    variants: tuple[str, ...] = tuple(VARIANTS)
    warmup: float = 0.2  # share of each point's span not counted
    trace: tuple[Visit, ...] | None = None
    events: tuple[FleetEvent, ...] = ()
    bin_s: float = 5.0  # the timeline's resolution

    @property
    def slo_ms(self) -> float:
        return self.fleet.trigger.slo_ms


@dataclass(slots=True)
class PointResult:
    """One variant at one rate and seed."""

    variant: str
    seed: int
    point: Point
    fleet: dict[str, Any]
    timeline: list[dict[str, float]]
    wall_s: float
    simulated: int
    peak: MemoryUse = field(default_factory=MemoryUse)  # the most one ranker's tiers held

    def summary(self, slo_ms: float) -> dict[str, Any]:
        p = self.point
        return {
            "variant": self.variant,
            "seed": self.seed,
            **p.summary(latencies=False),  # thousands of Ranks a point; rerun by seed
            "hit_ratio": p.hit_ratio,
            "relayed_ratio": p.relayed_ratio,
            "cached_ratio": p.cached_ratio,
            "within_slo_per_s": p.within_slo_per_s(slo_ms),
            "fleet": self.fleet,
            "timeline": self.timeline,
            "wall_s": self.wall_s,
            "simulated_requests": self.simulated,
        }


@dataclass(slots=True)
class SweepResult:
    spec: SweepSpec
    points: list[PointResult] = field(default_factory=list)

    def compliant(self, variant: str, seed: int) -> float:
        mine = [r.point for r in self.points if r.variant == variant and r.seed == seed]
        return max_compliant(mine, self.spec.slo_ms)

    def throughput(self) -> dict[str, dict[str, float]]:
        """SLO-compliant throughput per variant: median and range over seeds."""
        out: dict[str, dict[str, float]] = {}
        for variant in self.spec.variants:
            values = [self.compliant(variant, seed) for seed in self.spec.seeds]
            out[variant] = {
                "median": statistics.median(values),
                "low": min(values),
                "high": max(values),
            }
        return out

    def speed(self) -> dict[str, float]:
        wall = sum(r.wall_s for r in self.points)
        simulated = sum(r.simulated for r in self.points)
        return {
            "simulated_requests": simulated,
            "wall_s": wall,
            "requests_per_wall_s": simulated / wall if wall else 0.0,
        }


def run_sweep(
    spec: SweepSpec, on_point: Callable[[PointResult], None] = lambda _: None, jobs: int = 1
) -> SweepResult:
    """Every (variant, rate, seed) point, each on a fresh fleet, `jobs` at once in worker
    processes (`tooling.sim.processes`: the points are the same whatever the count);
    `on_point` hears each one, in order."""
    result = SweepResult(spec)
    rates = (0.0,) if spec.trace is not None else spec.rates
    asks = [(v, rate, seed) for seed in spec.seeds for rate in rates for v in spec.variants]
    with Processes(functools.partial(_sweep_point, spec), jobs) as points:
        for done in points.each(asks):
            result.points.append(done)
            on_point(done)
    return result


def _sweep_point(spec: SweepSpec, variant: str, rate: float, seed: int) -> PointResult:
    """One point of `spec`: its visits (the trace, or drawn for the rate and seed), then a run."""
    if spec.trace is not None:
        span = spec.trace[-1].at if spec.trace else 0.0
        return run_point(spec, variant, len(spec.trace) / span if span else 0.0, seed,
                         spec.trace, span)  # fmt: skip
    visits = _last_drawn(spec.workload, rate, spec.duration_s, seed)
    return run_point(spec, variant, rate, seed, visits, spec.duration_s)


# The variants of a (rate, seed) run one after another: they share the visits last drawn.
_last_drawn = functools.lru_cache(maxsize=1)(light_visits)


def settings_for(base: FleetSettings, variant: str) -> FleetSettings:
    mode, serve_cached = VARIANTS[variant]
    return replace(
        base,
        trigger=replace(base.trigger, mode=mode),
        ranker=replace(base.ranker, relay_enabled=serve_cached),
    )


def run_point(
    spec: SweepSpec,
    variant: str,
    rate: float,
    seed: int,
    visits: Sequence[Visit],
    span_s: float,
) -> PointResult:
    started = time.perf_counter()
    with collector_paused():
        loop = EventLoop()
        fleet = Fleet(loop, spec.profile, settings_for(spec.fleet, variant), seed)
        for event in spec.events:
            schedule(fleet, event)
        for index, visit in enumerate(visits):
            fleet.visit(index, visit)
        settings = fleet.settings
        loop.run(until=span_s + settings.gap_s + settings.rank_timeout_s + 1.0)
        records = fleet.finished()
    wall = time.perf_counter() - started
    point = Point.of(variant, rate, visits, records, span_s * spec.warmup)
    return PointResult(
        variant,
        seed,
        point,
        fleet_summary(fleet, span_s),
        timeline(records, spec.bin_s, spec.slo_ms),
        wall,
        len(visits),
        fleet.stats.peak(),
    )


def fleet_summary(fleet: Fleet, span_s: float) -> dict[str, Any]:
    """What the fleet did, for sizing: relays, store writes and the directory."""
    stats = fleet.stats
    router = fleet.forwarder.stats
    ttl = fleet.settings.ranker.lease_ttl_s
    ranker_seconds = sum(1 for _ in fleet.rankers) * span_s  # rankers alive, at most
    busy = {name: seconds / span_s for name, seconds in sorted(stats.busy_s.items())}
    peak = stats.peak()  # the most any one ranker held, figure by figure
    return {
        **{
            k: v for k, v in dataclasses.asdict(stats).items() if k not in ("busy_s", "peak_memory")
        },
        "rankers": len(fleet.rankers),
        "utilisation_mean": statistics.fmean(busy.values()) if busy else 0.0,
        "utilisation_max": max(busy.values(), default=0.0),
        "directory_writes": router.directory_writes,
        "placed": {str(k): v for k, v in router.placed.items()},
        "refused_then_spilled": router.refused_then_spilled,
        # Each ranker renews its lease about three times per TTL (the client's keepalive).
        "lease_keepalives_estimate": ranker_seconds * 3 / ttl,
        "directory_entries_end": fleet.cluster.placements(),
        "peak_memory_per_ranker": {
            "device_used": peak.device_bytes,
            "device_pinned": peak.device_pinned_bytes,
            "host_used": peak.host_bytes,
        },
    }


def timeline(
    records: Sequence[RequestRecord], bin_s: float, slo_ms: float
) -> list[dict[str, float]]:
    """Per `bin_s` of Rank send time: Ranks, hit share, share within the SLO, failures."""
    bins: dict[int, Counter[str]] = {}
    for r in records:
        tally = bins.setdefault(int(r.at // bin_s), Counter())
        tally["ranks"] += 1
        if r.status != OK:
            tally["failed"] += 1
            continue
        tally["hits"] += r.outcome in HIT_OUTCOMES
        tally["within_slo"] += r.latency_s * 1e3 <= slo_ms
    return [
        {
            "t": k * bin_s,
            "ranks": c["ranks"],
            "hit_ratio": c["hits"] / c["ranks"],
            "within_slo_ratio": c["within_slo"] / c["ranks"],
            "failed": c["failed"],
        }
        for k, c in sorted(bins.items())
    ]
