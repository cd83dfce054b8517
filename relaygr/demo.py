"""`make demo`: the whole mesh on this machine, relay vs no relay on the same traffic.

Brings up etcd, two rankers, a router and a trigger as separate processes, drives the full
pipeline open loop (retrieval event to the trigger, the ranking request to the router one gap
later) first with the trigger off, then with the sequence-aware trigger, on two copies of the
same seeded user population, prints the comparison, writes a PNG chart and shuts everything down.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from relaygr.drive import Point, drive_mesh
from relaygr.mesh import LocalMesh, MeshSpec
from relaygr.ranker.model_config import ModelConfig
from relaygr.workload import Population, WorkloadSpec, poisson_arrivals

TIERS = ("hbm_hit", "dram_hit", "waited_inflight", "extended", "miss")


def _profile(quick: bool) -> tuple[ModelConfig, WorkloadSpec, dict[str, float]]:
    """Model, workload and knobs sized so that 2 CPU cores show the effect within a minute or
    two (`quick`: a small model and short histories, for CI)."""
    if quick:
        model = ModelConfig(d_model=64, num_heads=2, d_qk=16, d_v=32, num_layers=2)
        spec = WorkloadSpec(users=100, median_long_term=512, max_long_term=2048, gap_s=0.5)
        return model, spec, {"rate": 6.0, "duration": 12.0, "slo_ms": 250.0, "margin_ms": 225.0}
    model = ModelConfig(d_model=256, num_heads=2, d_qk=32, d_v=64, num_layers=3)
    return (
        model,
        WorkloadSpec(),
        {"rate": 6.0, "duration": 40.0, "slo_ms": 1500.0, "margin_ms": 1400.0},
    )


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label = total, 0, label
        self._last = 0.0

    def step(self) -> None:
        self.done += 1
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
    population = Population(replace(spec, user_prefix=label), np.random.default_rng(seed))
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
    header = f"{'':<10} {'P50 ms':>8} {'P99 ms':>8} {'in-SLO req/s':>13} " + " ".join(
        f"{t.replace('_', ' '):>9}" for t in ("hbm", "dram", "waited", "extended", "miss")
    )
    lines = [header, "-" * len(header)]
    for p in points:
        tiers = " ".join(f"{p.outcomes.get(t, 0) / max(p.ok, 1):>9.0%}" for t in TIERS)
        in_slo = p.within_slo_per_s(slo_ms)
        lines.append(f"{p.label:<10} {p.p50_ms:>8.0f} {p.p99_ms:>8.0f} {in_slo:>13.1f} {tiers}")
    for p in points:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(p.reasons.items()))
        errors = ", ".join(f"{k} {v}" for k, v in p.errors.items()) or "none"
        lines.append(f"{p.label} admissions: {reasons}; failed Ranks: {errors}")
    return "\n".join(lines)


def chart(points: Sequence[Point], slo_ms: float, path: Path) -> None:
    """Latency CDF per phase with the SLO marked (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in points:
        lat = np.sort(np.asarray(p.latencies_ms))
        if len(lat):
            ax.plot(
                lat,
                np.arange(1, len(lat) + 1) / len(lat),
                label=f"{p.label} (P99 {p.p99_ms:.0f} ms)",
            )
    ax.axvline(slo_ms, color="grey", linestyle="--", label=f"SLO {slo_ms:.0f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("ranking latency from intended send time (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("RelayGR local mesh: relay vs no relay, same traffic")
    ax.legend(loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relaygr demo", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small model, short run (for CI)")
    parser.add_argument("--rate", type=float, help="arrivals per second (default per profile)")
    parser.add_argument("--duration", type=float, help="seconds per phase (default per profile)")
    parser.add_argument("--seed", type=int, default=None, help="workload seed (default: random)")
    parser.add_argument("--out", type=Path, default=Path("demo-results"), help="chart and JSON")
    args = parser.parse_args(argv)
    model, spec, knobs = _profile(args.quick)
    if args.rate is not None:
        knobs["rate"] = args.rate
    if args.duration is not None:
        knobs["duration"] = args.duration
    seed = args.seed if args.seed is not None else secrets.randbelow(2**32)
    print(
        f"RelayGR demo: etcd + 2 rankers + router + trigger on loopback; {knobs['rate']:g} req/s "
        f"for {knobs['duration']:g} s per phase, SLO {knobs['slo_ms']:.0f} ms, seed {seed}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="relaygr-demo-") as tmp:
        model_path = Path(tmp) / "model.json"
        model_path.write_text(json.dumps(model.to_dict()))
        mesh_spec = MeshSpec(
            rankers=2,
            ranker_args=("--model-config", str(model_path), "--device", "cpu"),
            trigger_args=("--slo-ms", str(knobs["slo_ms"]), "--margin-ms", str(knobs["margin_ms"])),
        )
        print("starting the mesh (rankers calibrate their cost model first) ...", flush=True)
        with LocalMesh(mesh_spec) as mesh:
            print(mesh.describe(), flush=True)
            points = [
                run_phase(mesh, "no relay", "off", spec, knobs, seed),
                run_phase(mesh, "relay", "sequence-aware", spec, knobs, seed),
            ]
    print()
    print(table(points, knobs["slo_ms"]))
    args.out.mkdir(parents=True, exist_ok=True)
    chart(points, knobs["slo_ms"], args.out / "relay_demo.png")
    (args.out / "relay_demo.json").write_text(
        json.dumps(
            {"seed": seed, "knobs": knobs, "points": [p.summary() for p in points]}, indent=2
        )
    )
    print(f"\nchart: {args.out / 'relay_demo.png'}; numbers: {args.out / 'relay_demo.json'}")
    print("mesh stopped; every process it started has exited.")
    return 0 if all(p.ok for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
