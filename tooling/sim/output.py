"""A simulation's results as JSON (everything), Markdown (the tables) and PNG (P99 by rate)."""

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from services.trigger.policy import relays_admitted
from tooling.sim.sweep import BASELINES, RELAYS, SweepResult


def to_json(result: SweepResult, command: str) -> dict[str, Any]:
    spec = result.spec
    profile = spec.profile
    return {
        "command": command,
        "profile": {
            **{k: v for k, v in dataclasses.asdict(profile).items() if k != "cost"},
            "cost": dataclasses.asdict(profile.cost),
        },
        "fleet": {
            "rankers": spec.fleet.rankers,
            "gap_s": spec.fleet.gap_s,
            "trigger": _config(spec.fleet.trigger),
            "router": _config(spec.fleet.router),
            "ranker": _config(spec.fleet.ranker),
        },
        "workload": None if spec.trace is not None else dataclasses.asdict(spec.workload),
        "trace_visits": None if spec.trace is None else len(spec.trace),
        "rates": list(spec.rates),
        "duration_s": spec.duration_s,
        "seeds": list(spec.seeds),
        "events": [dataclasses.asdict(e) for e in spec.events],
        "slo_ms": spec.slo_ms,
        "points": [p.summary(spec.slo_ms) for p in result.points],
        "slo_compliant_throughput": result.throughput(),
        "speed": result.speed(),
    }


def _config(cfg: object) -> dict[str, Any]:
    raw = dataclasses.asdict(cfg)  # type: ignore[call-overload]
    return {
        k: v if isinstance(v, int | float | str | bool) or v is None else str(v)
        for k, v in raw.items()
    }


def markdown(data: dict[str, Any]) -> str:
    profile = data["profile"]
    lines = [
        "## Simulated: " + ", ".join(sorted({p["variant"] for p in data["points"]})),
        "",
        f"Reproduce: `{data['command']}`.",
        "",
        f"- Profile: {profile['name']} ({profile['kind']}); device tier "
        f"{profile['device_tier_bytes'] / 2**20:,.0f} MiB, host tier "
        f"{profile['host_tier_bytes'] / 2**20:,.0f} MiB, {profile['kv_bytes_per_token']:,} bytes "
        f"per cached token; request overhead {profile['request_overhead_ms']} ms.",
        f"- Fleet: {data['fleet']['rankers']} rankers; SLO {data['slo_ms']:g} ms; gap "
        f"{data['fleet']['gap_s'] * 1e3:g} ms; seeds {', '.join(map(str, data['seeds']))}.",
        f"- Speed: {data['speed']['simulated_requests']:,} simulated requests in "
        f"{data['speed']['wall_s']:.1f} s ({data['speed']['requests_per_wall_s']:,.0f} per "
        "wall-clock second).",
    ]
    if data["events"]:
        events = ", ".join(f"{e['at']:g} s {e['kind']} {e['arg']}".strip() for e in data["events"])
        lines.append(f"- Fleet events: {events}.")
    lines += [
        "",
        f"**SLO-compliant throughput** at {data['slo_ms']:g} ms (req/s; median [range] over "
        "seeds):",
        "",
        "| variant | req/s |",
        "|---|---:|",
    ]
    throughput = data["slo_compliant_throughput"]
    for variant, t in throughput.items():
        lines.append(f"| {variant} | {_spread(t)} |")
    verdict = _verdict(throughput)
    if verdict:
        lines += ["", verdict]
    lines += [
        "",
        "| variant | seed | rate req/s | Ranks | P50 ms | P99 ms | hits | relayed | "
        "cross-visit | admitted | not at risk | no room / footprint / load | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for p in data["points"]:
        reasons = p["reasons"]
        refusals = "/".join(
            str(reasons.get(k, 0)) for k in ("no_room", "footprint_limit", "load_limit")
        )
        lines.append(
            f"| {p['variant']} | {p['seed']} | {p['rate']:g} | {p['ok']:,} | {p['p50_ms']:.1f} "
            f"| {p['p99_ms']:.1f} | {p['hit_ratio']:.0%} | {p['relayed_ratio']:.0%} "
            f"| {p['cached_ratio']:.0%} | {relays_admitted(reasons):,} "
            f"| {reasons.get('not_at_risk', 0):,} | {refusals} | {p['sent'] - p['ok']:,} |"
        )
    return "\n".join(lines) + "\n"


def _spread(t: dict[str, float]) -> str:
    if t["low"] == t["high"]:
        return f"{t['median']:g}"
    return f"{t['median']:g} [{t['low']:g}-{t['high']:g}]"


def _verdict(throughput: dict[str, dict[str, float]]) -> str:
    relays = {v: t["median"] for v, t in throughput.items() if v in RELAYS}
    bases = {v: t["median"] for v, t in throughput.items() if v in BASELINES}
    if not relays or not bases:
        return ""
    relay, base = max(relays, key=relays.__getitem__), max(bases, key=bases.__getitem__)
    if bases[base] == 0:
        return (
            f"Best relay ({relay}) {relays[relay]:g} req/s; the best baseline is never compliant."
        )
    return (
        f"Best relay ({relay}) vs best baseline ({base}): "
        f"**{relays[relay] / bases[base]:.2f}x** (medians)."
    )


def chart(data: dict[str, Any], path: Path) -> bool:
    """P99 by offered rate, one line per variant (median over seeds); False without
    matplotlib (the `dev` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    variants = sorted({p["variant"] for p in data["points"]})
    for variant in variants:
        rates = sorted({p["rate"] for p in data["points"] if p["variant"] == variant})
        p99 = [
            statistics.median(
                p["p99_ms"] for p in data["points"] if p["variant"] == variant and p["rate"] == r
            )
            for r in rates
        ]
        ax.plot(rates, p99, marker="o", label=variant)
    ax.axhline(data["slo_ms"], color="grey", linestyle="--", linewidth=1, label="SLO")
    ax.set_xlabel("offered rate, req/s")
    ax.set_ylabel("ranking P99, ms")
    ax.set_yscale("log")
    ax.set_title(f"Simulated: {data['profile']['name']}, {data['fleet']['rankers']} rankers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(data: dict[str, Any], out: Path) -> list[Path]:
    """results.json, results.md and p99.png (when matplotlib is there) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.md"]
    written[0].write_text(json.dumps(data, indent=1, default=str) + "\n")
    written[1].write_text(markdown(data))
    if chart(data, out / "p99.png"):
        written.append(out / "p99.png")
    return written
