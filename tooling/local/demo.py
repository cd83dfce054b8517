"""`make demo`: the whole mesh on this machine: cache only, relay and no cache on the same traffic.

Brings up etcd, two rankers, a router and a trigger as separate processes and drives the full
pipeline open loop (retrieval event to the trigger, the ranking request to the router one gap
later) on copies of the same seeded traffic from a large user population: first `cache only`
(nothing pre-inferred; the rankers keep what their Ranks computed, so return visits can hit),
then `relay` (the sequence-aware trigger), then `no cache` on a second mesh whose rankers bypass
every cache. Prints P50/P95/P99 against the SLO and where each Rank's prefix came from (relayed,
left by an earlier visit, or full inference), writes a PNG chart and a JSON file, and shuts
everything down.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from relaygr.bounds import POSITIVE, Bounded
from relaygr.cli_help import HelpFormatter
from services.ranker.model_config import PRESETS, ModelPreset
from tooling.local.drive import Point, drive_mesh
from tooling.local.mesh import LocalMesh, MeshSpec
from tooling.local.workload import Population, WorkloadSpec, poisson_arrivals

# (label, trigger mode, mesh): the phases, in the order they run.
PHASES = (("cache only", "off", "cached"), ("relay", "sequence-aware", "cached"),
          ("no cache", "off", "bypass"))  # fmt: skip


def _profile(quick: bool) -> tuple[ModelPreset, WorkloadSpec, dict[str, float]]:
    """Model, workload and knobs sized so that 2 CPU cores show the effect within a minute or
    two (`quick`: the tiny model and short histories, for CI). The population is large, as in
    production: the rankers' tiers hold a small fraction of its users."""
    if quick:
        spec = WorkloadSpec(
            users=100_000, median_long_term=512, long_term_sigma=0.8, max_long_term=2048,
            candidates=PRESETS[ModelPreset.TINY].max_candidates, gap_s=0.5,
        )  # fmt: skip
        knobs = {"rate": 6.0, "duration": 12.0, "slo_ms": 250.0, "margin_ms": 225.0}
        return ModelPreset.TINY, spec, knobs
    return (
        ModelPreset.SMALL,
        WorkloadSpec(gap_s=1.5),
        # The relay benchmark's regime: at 0.5 req/s the relay met this SLO in 2 of 3 seeds and
        # cache only in none (docs/benchmarks.md); two single-thread rankers saturate ~2.5 req/s.
        {"rate": 0.5, "duration": 90.0, "slo_ms": 1500.0, "margin_ms": 1250.0},
    )


class Progress:
    """Progress on stderr: in a terminal a one-line bar redrawn in place; elsewhere (a log, CI)
    a plain line at each quarter, so a log holds four lines a phase rather than every redraw."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label = total, 0, label
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self._quarter = 0

    def step(self) -> None:
        self.done += 1
        if not self._tty:
            quarter = 4 * self.done // max(self.total, 1)
            if quarter > self._quarter:
                self._quarter = quarter
                print(f"  {self.label:<10} {self.done}/{self.total}", file=sys.stderr, flush=True)
            return
        now = time.monotonic()
        if now - self._last > 0.2 or self.done == self.total:
            self._last = now
            filled = int(30 * self.done / max(self.total, 1))
            bar = "#" * filled + "." * (30 - filled)
            end = "\n" if self.done == self.total else ""
            print(
                f"\r  {self.label:<10} [{bar}] {self.done}/{self.total}",
                end=end,
                file=sys.stderr,
                flush=True,
            )


def run_phase(
    mesh: LocalMesh, label: str, mode: str, spec: WorkloadSpec, knobs: dict[str, float], seed: int
) -> Point:
    user_prefix = label.replace(" ", "-")
    population = Population(replace(spec, user_prefix=user_prefix), np.random.default_rng(seed))
    arrivals = poisson_arrivals(population, knobs["rate"], knobs["duration"])
    progress = Progress(len(arrivals), label)
    return drive_mesh(
        mesh,
        mode,
        arrivals,
        label=label,
        rate=knobs["rate"],
        gap_s=spec.gap_s,
        warmup_s=knobs["duration"] * 0.2,
        timeout_s=30.0,
        on_done=progress.step,
    )


def table(points: Sequence[Point], slo_ms: float) -> str:
    """P50/P95/P99 against the SLO, and where each answered Rank's prefix came from."""
    header = (
        f"{'':<11} {'Ranks':>6} {'P50 ms':>8} {'P95 ms':>8} {'P99 ms':>8} {'P99 vs SLO':>11} "
        f"{'relayed':>8} {'cached':>8} {'full inf':>8}"
    )
    lines = [header, "-" * len(header)]
    for p in points:
        verdict = "within" if p.compliant(slo_ms) else "OVER"
        full = 1.0 - p.hit_ratio if p.ok else 0.0
        lines.append(
            f"{p.label:<11} {p.ok:>6} {p.p50_ms:>8.0f} {p.p95_ms:>8.0f} {p.p99_ms:>8.0f} "
            f"{verdict:>11} {p.relayed_ratio:>8.0%} {p.cached_ratio:>8.0%} {full:>8.0%}"
        )
    lines.append(
        f"(SLO: P99 <= {slo_ms:.0f} ms. relayed: prefix pre-inferred for this visit; cached: "
        "left by an earlier visit; full inf: computed inside the Rank.)"
    )
    for p in points:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(p.reasons.items())) or "none"
        errors = ", ".join(f"{k} {v}" for k, v in p.errors.items()) or "none"
        lines.append(f"{p.label} admissions: {reasons}; failed Ranks: {errors}")
    return "\n".join(lines)


def chart(points: Sequence[Point], slo_ms: float, path: Path) -> bool:
    """Latency CDF per phase with the SLO marked, and where each phase's prefixes came from
    (PNG). Phases with no answered Rank are left out; with none at all, nothing is drawn and
    False is returned."""
    drawn = [p for p in points if p.latencies_ms]
    if not drawn:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=(3, 2))
    for p in drawn:
        lat = np.sort(np.asarray(p.latencies_ms))
        cdf.plot(
            lat, np.arange(1, len(lat) + 1) / len(lat), label=f"{p.label} (P99 {p.p99_ms:.0f} ms)"
        )
    cdf.axvline(slo_ms, color="grey", linestyle="--", label=f"SLO {slo_ms:.0f} ms")
    cdf.set(xscale="log", xlabel="ranking latency from intended send time (ms)")
    cdf.set(ylabel="fraction of Ranks", title="Same traffic, three systems")
    cdf.legend(loc="lower right", fontsize=8)
    cdf.grid(True, which="both", alpha=0.3)
    names = [p.label for p in drawn]
    relayed = np.array([p.relayed_ratio for p in drawn])
    cached = np.array([p.cached_ratio for p in drawn])
    bars.bar(names, relayed, label="relayed")
    bars.bar(names, cached, bottom=relayed, label="cached (earlier visit)")
    bars.bar(names, 1 - relayed - cached, bottom=relayed + cached, label="full inference")
    bars.set(ylabel="share of Ranks", title="Where each Rank's prefix came from", ylim=(0, 1))
    bars.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relaygr demo", description=__doc__, formatter_class=HelpFormatter
    )
    quick, full = _profile(True)[2], _profile(False)[2]
    parser.add_argument("--quick", action="store_true", help="tiny model, short run (for CI)")
    for name, text in (("rate", "arrivals per second"), ("duration", "seconds per phase")):
        parser.add_argument(
            f"--{name}",
            type=Bounded(float, POSITIVE),
            help=f"{text} (default: {full[name]:g}, with --quick {quick[name]:g})",
        )
    parser.add_argument("--seed", type=int, default=None, help="workload seed (default: random)")
    parser.add_argument("--out", type=Path, default=Path("demo-results"), help="chart and JSON")
    parser.add_argument(
        "--no-bypass", action="store_true", help="skip the `no cache` phase and its second mesh"
    )
    args = parser.parse_args(argv)
    model, spec, knobs = _profile(args.quick)
    if args.rate is not None:
        knobs["rate"] = args.rate
    if args.duration is not None:
        knobs["duration"] = args.duration
    seed = args.seed if args.seed is not None else secrets.randbelow(2**32)
    phases = [phase for phase in PHASES if not (args.no_bypass and phase[2] == "bypass")]
    print(
        f"RelayGR demo: etcd + 2 rankers + router + trigger on loopback; {knobs['rate']:g} req/s "
        f"for {knobs['duration']:g} s per phase ({', '.join(p[0] for p in phases)}), "
        f"{spec.users:,} users, SLO {knobs['slo_ms']:.0f} ms, seed {seed}",
        flush=True,
    )
    points: list[Point] = []
    base = MeshSpec(
        rankers=2,
        ranker_args=("--model", model.value, "--device", "cpu"),
        trigger_args=(
            "--slo-ms",
            str(knobs["slo_ms"]),
            "--margin-ms",
            str(knobs["margin_ms"]),
            "--expected-gap-ms",
            str(spec.gap_s * 1e3),
        ),
    )
    for kind in dict.fromkeys(p[2] for p in phases):
        mesh_spec = base
        if kind == "bypass":
            mesh_spec = replace(base, ranker_args=(*base.ranker_args, "--no-relay-enabled"))
        print(
            f"starting the {kind} mesh (rankers calibrate their cost model first) ...", flush=True
        )
        with LocalMesh(mesh_spec) as mesh:
            print(mesh.describe(), flush=True)
            for label, mode, on in phases:
                if on == kind:
                    points.append(run_phase(mesh, label, mode, spec, knobs, seed))
    print()
    print(table(points, knobs["slo_ms"]))
    args.out.mkdir(parents=True, exist_ok=True)
    drew = chart(points, knobs["slo_ms"], args.out / "relay_demo.png")
    (args.out / "relay_demo.json").write_text(
        json.dumps(
            {"seed": seed, "knobs": knobs, "points": [p.summary() for p in points]}, indent=2
        )
    )
    where = f"chart: {args.out / 'relay_demo.png'}; " if drew else "no Rank answered: no chart; "
    print(f"\n{where}numbers: {args.out / 'relay_demo.json'}")
    print("mesh stopped; every process it started has exited.")
    return 0 if all(p.ok for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
