"""What `relaygr plan` prints and writes: the answer, a table of it beside one ranker fewer and
the profile's full tier, the search, the assumptions and the command that reproduces it."""

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tooling.sim.plan import Plan, Run, Slice, Trial, host_estimate, round_up
from tooling.sim.sweep import VARIANTS, SweepSpec

# What slicing cost where the whole fleet could be simulated beside it (docs/simulator.md,
# "Planning a fleet"); --check-slice measures it for the case at hand.
SLICE_MEASURED = (
    "measured on nvidia-h200 against the whole fleet (SLO 20 ms, 30 s runs; "
    "bench/results/plan_bench.json): at 10 rankers and 640 req/s a slice of 8 read P99 from 22% "
    "low to 3% high and hit rates within 1 point over 5 seeds, the whole fleet missing a 20 ms "
    "SLO its slice met on 2 of them (at 9 rankers and 320 req/s, 5% low to 15% high). Near "
    "capacity a fleet's P99 is set by its hottest rankers, and more rankers have hotter ones. An "
    "answer within ~22% of the SLO is worth --check-slice"
)


def size(nbytes: float) -> str:
    """Bytes as a person reads them: GiB from one GiB, then MiB, then KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}".replace(".0 ", " ")
    return f"{nbytes:,.0f} B"


@dataclass(frozen=True, slots=True)
class Ask:
    """The question as asked, and how it was simulated: what the report says beside the plan."""

    command: str  # the command line that reproduces the plan
    qps: float
    slo_ms: float
    variant: str
    slice: int
    max_rankers: int
    min_ranks: int
    rankers_per_trigger: int
    source: str  # the profile's file, or the ranker it was read from
    trace: str | None
    spec: SweepSpec  # the profile at its own tier; the services' configurations; workload

    @property
    def host_cap_bytes(self) -> int:
        return self.spec.profile.host_tier_bytes

    @property
    def dram_ttl_s(self) -> float:
        return self.spec.fleet.ranker.dram_ttl_s

    def slice_at(self, rankers: int) -> Slice:
        return Slice.of(rankers, self.slice)


@dataclass(frozen=True, slots=True)
class SliceCheck:
    """One seed at the answer, simulated as the slice and as the whole fleet."""

    slice: Run
    whole: Run


def host_memory(plan: Plan, ask: Ask) -> tuple[int, int]:
    """The answer's host tier: (estimated steady-state bytes, what to give each ranker)."""
    assert plan.answer is not None
    estimate = host_estimate(plan.answer.memory.host_bytes, plan.answer.span_s, ask.dram_ttl_s)
    estimate = min(estimate, ask.host_cap_bytes)
    return estimate, min(round_up(estimate, plan.goal.memory_step_bytes), ask.host_cap_bytes)


def assumptions(plan: Plan, ask: Ask, whole: bool = False) -> list[str]:
    spec, profile = ask.spec, ask.spec.profile
    mode, serve = VARIANTS[ask.variant]
    lines = [
        f"Variant: {ask.variant} (trigger mode {mode.value}; rankers "
        f"{'serve from' if serve else 'bypass'} their caches).",
        f"Profile: {profile.name} ({profile.kind}), {ask.source}: "
        f"{profile.description or 'no description'}. {len(profile.sources)} sources and "
        f"{len(profile.assumptions)} labelled guesses are in the profile"
        + (
            f"; its cost model's fit error is {profile.cost.median_abs_rel_error:.0%} over "
            f"{profile.cost.samples} samples"
            if profile.kind == "measured"
            else ""
        )
        + ".",
    ]
    for source in profile.sources:
        lines.append(f"  source: {source[:110]}{'...' if len(source) > 110 else ''}")
    at = ask.slice_at(plan.rankers or ask.max_rankers)
    at_answer = (
        "At the answer: the whole fleet, simulated whole (the slice's answer missed on it)"
        if whole
        else f"At the answer: {at.rankers} of {at.fleet} rankers at {at.rate(ask.qps):,.1f} req/s"
        + ("" if spec.trace is not None else f" over {at.users(spec.workload.users):,} users")
    )
    lines.append(
        f"Slice: N rankers at {ask.qps:g} req/s are simulated as k = min(N, {ask.slice}) "
        "rankers at k/N of the rate over k/N of the users: rendezvous hashing spreads users, "
        f"and so load, evenly over rankers. {at_answer}. The approximation, {SLICE_MEASURED}."
    )
    w = spec.workload
    if spec.trace is not None:
        lines.append(
            f"Workload: the trace {ask.trace} ({len(spec.trace):,} visits), time-scaled to "
            f"{ask.qps:g} req/s; the slice replays the visits of the users it owns."
        )
    else:
        lines.append(
            f"Workload: {w.users:,} users, Zipf s={w.zipf_s} over sessions; long-term history "
            f"log-normal, median {w.median_long_term:,}, sigma {w.long_term_sigma:g}, within "
            f"[{w.min_long_term:,}, {w.max_long_term:,}]; short-term {w.short_term[0]}-"
            f"{w.short_term[1]}; {w.candidates} candidates; revisit p={w.revisit_p:g} after "
            f"~{w.revisit_gap_s:g} s; retrieval to Rank {spec.fleet.gap_s * 1e3:g} ms."
        )
    seeds = ", ".join(map(str, plan.goal.seeds))
    if spec.trace is not None:
        length = "replays the slice's share of the trace"
    else:
        length = (
            f"simulates {spec.duration_s:g} s, or long enough to count {ask.min_ranks:,} "
            "Ranks at the slice's rate if longer"
        )
    if plan.answer is not None:
        length += (
            f"; at the answer {plan.answer.span_s:,.0f} s, {plan.answer.ranks:,} Ranks counted "
            "per seed"
        )
    lines += [
        f"Seeds {seeds}: a size passes only if on every seed P99 <= {ask.slo_ms:g} ms and no "
        f"Rank failed. Each run {length}; the first {spec.warmup:.0%} is not counted. P50 and "
        "P99 are the worst seed's, hits and relays the mean over seeds.",
        "Search: the fewest rankers by doubling then bisection at the profile's device tier "
        f"({size(plan.goal.device_tier_bytes)}); at that count, the device tier by halving then "
        f"bisection on a {size(plan.goal.memory_step_bytes)} grid. Both assume more never "
        "hurts; near the boundary, noise can break that (compare the rows).",
        "Memory: device (HBM) and host (DRAM) use are the prefix-cache tiers' bytes, sampled "
        f"every {spec.fleet.trigger.observe_interval_ms} ms, the most any one ranker held on "
        "any seed. The device tier is the prefix-cache budget, not the device's size: weights, "
        "activations and the runtime come on top.",
    ]
    if plan.answer is not None:
        lines.append(_host_line(plan.answer, ask, *host_memory(plan, ask)))
    per_trigger = (
        "one per ranker"
        if ask.rankers_per_trigger == 1
        else f"one per {ask.rankers_per_trigger} rankers"
    )
    lines.append(
        "Not simulated (docs/simulator.md): etcd round trips (a directory write is visible at "
        "once); the network beyond a fixed per-request overhead "
        f"({profile.request_overhead_ms:g} ms, half each way); compute variance beyond the "
        f"profile's compute_noise ({profile.compute_noise:g}); histories that change other "
        "than by appending; ranker failures and membership changes; trigger replicas' own "
        f"books (the slice's replicas, {per_trigger}, share one admission policy's, which is "
        "optimistic)."
    )
    return lines


def _host_line(answer: Trial, ask: Ask, estimate: int, give: int) -> str:
    peak, cap = answer.memory.host_bytes, ask.host_cap_bytes
    text = f"Host memory: the host tier keeps an entry {ask.dram_ttl_s:g} s"
    if answer.span_s < ask.dram_ttl_s:
        text += (
            f", longer than the {answer.span_s:,.0f} s simulated, so its peak ({size(peak)}) "
            f"is scaled to the TTL as if it filled at a steady rate: {size(estimate)}"
        )
    text += f"; rounded up, {size(give)} per ranker"
    if peak >= cap:
        return text + ": the configured cap (the profile's host tier) filled up."
    if give >= cap:
        return text + ", the configured cap (the profile's host tier)."
    return text + f", under the configured cap of {size(cap)} (the profile's host tier)."


def _rows(plan: Plan) -> list[tuple[str, Trial]]:
    out: list[tuple[str, Trial]] = []
    if plan.answer is not None and plan.at_top is not None:
        out.append(("answer", plan.answer))
        if plan.at_top.device_tier_bytes != plan.answer.device_tier_bytes:
            out.append(("answer, profile's tier", plan.at_top))
    if plan.fewer is not None:
        label = "one ranker fewer" if plan.answer is not None else "most rankers tried"
        out.append((label, plan.fewer))
    return out


def _table(plan: Plan, slo_ms: float) -> list[str]:
    lines = [
        "| | rankers | device tier | peak device (pinned) | peak host | P50 ms | P99 ms | hits "
        "| relayed | failed | meets SLO |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, t in _rows(plan):
        m = t.memory
        lines.append(
            f"| {label} | {t.rankers} | {size(t.device_tier_bytes)} | {size(m.device_bytes)} "
            f"({size(m.device_pinned_bytes)}) | {size(m.host_bytes)} | {t.p50_ms:.1f} "
            f"| {t.p99_ms:.1f} | {t.hit_ratio:.0%} | {t.relayed_ratio:.0%} | {t.failed} "
            f"| {'yes' if t.passed else 'no'} |"
        )
    return lines


def report(plan: Plan, ask: Ask, check: Sequence[SliceCheck], sliced: Plan | None = None) -> str:
    """The printed plan; `sliced`: the slice's plan, where the whole fleet missed the SLO at its
    answer and `plan` is the search that went on with whole fleets."""
    head = (
        f"relaygr plan: {ask.qps:g} req/s within a {ask.slo_ms:g} ms P99, "
        f"{ask.variant}, on {ask.spec.profile.name}"
    )
    lines = [head, ""]
    if plan.answer is None:
        lines.append(
            f"No fleet of up to {ask.max_rankers} rankers meets the SLO: rankers add "
            "throughput, not speed; a single Rank's latency bounds P99 (shorter histories, "
            "a faster device or a looser SLO)."
        )
    else:
        _, give = host_memory(plan, ask)
        lines.append(
            f"Answer: {plan.answer.rankers} rankers, each with a "
            f"{size(plan.answer.device_tier_bytes)} device (HBM) prefix-cache tier and "
            f"{size(give)} of host (DRAM) tier (cap {size(ask.host_cap_bytes)})."
        )
    if sliced is not None and sliced.answer is not None:
        lines.append(
            f"Simulated whole: the slice's answer, {sliced.answer.rankers} rankers with "
            f"{size(sliced.answer.device_tier_bytes)}, missed the SLO as a whole fleet (the "
            f"check below), so the search ran again from {sliced.answer.rankers} rankers at the "
            "profile's tier with every fleet simulated whole."
        )
    lines += ["", *_table(plan, ask.slo_ms), ""]
    if sliced is not None:
        lines += [f"Searched (slices): {_steps(sliced)}.", f"Then whole: {_steps(plan)}.", ""]
    else:
        lines += [f"Searched: {_steps(plan)}.", ""]
    if check:
        lines += [*_check_lines(check, ask.slo_ms), ""]
    notes = assumptions(plan, ask, whole=sliced is not None)
    lines += ["Assumptions:", *(a if a.startswith("  ") else f"- {a}" for a in notes)]
    lines += ["", f"Reproduce: {ask.command}"]
    return "\n".join(lines) + "\n"


def _steps(plan: Plan) -> str:
    return ", ".join(
        f"{t.rankers}x{size(t.device_tier_bytes)} {'pass' if t.passed else 'fail'}"
        for t in plan.steps
    )


def _check_lines(check: Sequence[SliceCheck], slo_ms: float) -> list[str]:
    lines = ["Slice check (--check-slice): the whole fleet simulated beside its slice:"]
    missed = [c.whole.seed for c in check if not c.whole.meets(slo_ms)]
    for c in check:
        sliced, full = c.slice, c.whole
        lines.append(
            f"- seed {full.seed}: P99 {full.p99_ms:.1f} ms whole, {sliced.p99_ms:.1f} ms slice "
            f"({sliced.p99_ms / full.p99_ms - 1:+.0%}); hits {full.hit_ratio:.1%} whole, "
            f"{sliced.hit_ratio:.1%} slice; relayed {full.relayed_ratio:.1%} whole, "
            f"{sliced.relayed_ratio:.1%} slice"
        )
    if missed:
        lines.append(
            f"The whole fleet misses the SLO on seed{'s' if len(missed) > 1 else ''} "
            f"{', '.join(map(str, missed))}: the slice was optimistic here, and the search "
            "above ran again with whole fleets."
        )
    return lines


def to_json(
    plan: Plan, ask: Ask, check: Sequence[SliceCheck], sliced: Plan | None = None
) -> dict[str, Any]:
    answer: dict[str, Any] | None = None
    if plan.answer is not None:
        estimate, give = host_memory(plan, ask)
        answer = {
            "rankers": plan.answer.rankers,
            "device_tier_bytes": plan.answer.device_tier_bytes,
            "host_bytes": give,
            "host_estimate_bytes": estimate,
            "host_cap_bytes": ask.host_cap_bytes,
        }
    return {
        "command": ask.command,
        "qps": ask.qps,
        "slo_ms": ask.slo_ms,
        "variant": ask.variant,
        "profile": ask.spec.profile.name,
        "goal": asdict(plan.goal),
        "answer": answer,
        "rows": [{"label": label, **_trial(t)} for label, t in _rows(plan)],
        "steps": [_trial(t) for t in plan.steps],
        "slice_check": [asdict(c) for c in check],
        # The slice's own answer and search, where the whole fleet missed at that answer.
        "sliced": None
        if sliced is None
        else {
            "answer": None if sliced.answer is None else _trial(sliced.answer),
            "steps": [_trial(t) for t in sliced.steps],
        },
        "assumptions": assumptions(plan, ask, whole=sliced is not None),
    }


def _trial(t: Trial) -> dict[str, Any]:
    return {
        "rankers": t.rankers,
        "device_tier_bytes": t.device_tier_bytes,
        "passed": t.passed,
        "runs": [asdict(r) for r in t.runs],
    }
