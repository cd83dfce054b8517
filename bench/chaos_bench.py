"""Chaos under load, the long run of tests/integration/test_chaos.py: a memory flood of
maximum-size PreInfers, then each fault of issue 9 in turn on a local mesh under steady
open-loop traffic (etcd, two rankers, two routers, a trigger; separate processes):

- a ranker killed with SIGKILL, left dead past its lease, restarted on its port;
- etcd stopped and restarted (same member, ports and data);
- a router restarted (SIGTERM: drain) while a second replica serves;
- a ranker made slow: its process frozen (SIGSTOP) part of every second;
- then that ranker frozen once, past its lease and past the deadline of the Ranks sent to it.

Every Rank either succeeds with scores checked against full inference of the rankers' own
checkpoint, or fails with a retryable status within its deadline; none may hang. Per fault it
reports what was sent, succeeded, failed and by which status, wrong scores, hung requests and the
time from the fault's end until every Rank hits a cache again.

    .venv/bin/python bench/chaos_bench.py           # ~5 min on 2 cores
    .venv/bin/python bench/chaos_bench.py --quick   # the CI test's sizes
"""

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.chaos import (
    CHAOS_MODEL,
    ChaosSettings,
    FaultReport,
    chaos_mesh_spec,
    chaos_workload,
    freeze_ranker,
    render_table,
    run_chaos,
    standard_faults,
)
from bench.flood import FloodReport, FloodSettings, RankerWatch, memory_flood
from bench.pipeline import ROOT, result_name, save_results
from bench.report import add_render_arguments, load_result, machine_info, run_stamp, write_section
from relaygr.behaviours import RankInput
from relaygr.cli_help import HelpFormatter
from services.ranker.checkpoint import load_checkpoint, save_checkpoint
from services.ranker.model import RankingModel
from tooling.local.mesh import LocalMesh
from tooling.local.workload import Population

NAME = "chaos_bench"


def run(args: argparse.Namespace) -> dict:
    started = machine_info()  # the commit this run measures, stamped before it runs
    settings = ChaosSettings(
        rate=args.rate,
        before_s=args.before,
        after_s=args.after,
        timeout_s=args.timeout,
        verify_share=args.verify_share,
    )
    faults = standard_faults(
        args.ranker_down, args.etcd_down, args.slow_for, args.stopped, args.period
    )
    if args.freeze > 0:
        faults.append(freeze_ranker("ranker-1", args.freeze))
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="relaygr-chaos-") as tmp:
        checkpoint = save_checkpoint(RankingModel(CHAOS_MODEL, seed=args.seed), Path(tmp))
        model = load_checkpoint(checkpoint)  # the reference: the rankers' own checkpoint
        torch.set_num_threads(1)  # beside five busy services, more threads only contend

        def reference(request: RankInput) -> np.ndarray:
            return model.full_forward(request).numpy()

        with LocalMesh(chaos_mesh_spec(checkpoint)) as mesh:
            # The flood first: the rankers' RSS after warm-up then holds no cache.
            flood_settings = FloodSettings(
                duration_s=args.flood_duration,
                concurrency=args.flood_concurrency,
                overhead_mb=args.overhead_mb,
            )
            flood = memory_flood(mesh, flood_settings, rng)
            print(flood.render(), flush=True)
            reports = run_chaos(
                mesh,
                faults,
                Population(chaos_workload(), rng),
                settings,
                reference,
                model.model_version,
                rng,
                on_report=lambda r: print(render_table([r]).splitlines()[-1], flush=True),
            )
            threads = mesh.ranker_threads
    return save_results(
        NAME,
        args,
        {
            "faults": [dataclasses.asdict(r) for r in reports],
            "flood": dataclasses.asdict(flood),
            "flood_settings": dataclasses.asdict(flood_settings),
            "settings": dataclasses.asdict(settings),
        },
        started,
        threads,
    )


def render(saved: dict) -> str:
    args = argparse.Namespace(**saved["args"])
    info = saved["machine"]
    reports = [FaultReport(**r) for r in saved["faults"]]
    raw_flood = dict(saved["flood"])
    watches = [RankerWatch(**w) for w in raw_flood.pop("rankers")]
    flood = FloodReport(**raw_flood, rankers=watches)
    s = ChaosSettings(**saved["settings"])
    f = FloodSettings(**saved["flood_settings"])
    ok = all(r.passed for r in reports) and not any(w.violations for w in watches)
    statuses = ", ".join(f"{n} {status}" for status, n in sorted(flood.statuses.items()))
    return "\n".join([
        "## Chaos under load" + (" (quick)" if args.quick else ""),
        "",
        f"Reproduce: `{saved['command']}`. What the faults are and what the mesh guarantees: "
        "[reliability.md](reliability.md).",
        "",
        f"- {run_stamp(info)}. Local mesh: etcd, two rankers "
        "(CPU, a 3-layer d_model 64 model, device tier 24 MiB, host tier 24 MiB, lease 2 s), two "
        "routers, a trigger relaying every event; clients round-robin over both routers.",
        f"- Traffic: open-loop Poisson, {s.rate:g} retrieval events/s, each Rank {s.gap_s:g} s "
        f"later; deadline {s.timeout_s:g} s per RPC; a call unanswered {s.hang_grace_s:g} s past "
        f"its deadline counts as hung. Each phase: {s.before_s:g} s steady, the fault, "
        f"{s.after_s:g} s after it. {s.verify_share:.0%} of successful Ranks checked against "
        f"full inference (relative error <= {s.tolerance:g}). Recovered: from then to the "
        f"phase's end every Rank (at least {s.recovered_after}) hits a cache.",
        f"- Result: **{'every guarantee held' if ok else 'A GUARANTEE FAILED'}**.",
        "",
        render_table(reports),
        "",
        f"**Memory flood**: {flood.sent} PreInfers of {flood.prefix_tokens} tokens "
        f"({flood.prefix_bytes / 2**20:.1f} MiB of KV each; {statuses}) over "
        f"{f.duration_s:g} s, {f.concurrency} in flight, relay window {f.relay_window_ms} ms; "
        f"tiers and RSS read every {f.poll_s * 1e3:.0f} ms. RSS limit = RSS after warm-up + "
        f"both tier budgets + {flood.overhead_bytes / 2**20:.0f} MiB stated overhead.",
        "",
        flood.render(),
    ])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--rate", type=float, default=20.0, help="retrieval events per second")
    parser.add_argument("--before", type=float, default=5.0, help="steady seconds before a fault")
    parser.add_argument("--after", type=float, default=20.0, help="seconds after a fault")
    parser.add_argument("--timeout", type=float, default=5.0, help="per-RPC deadline, seconds")
    parser.add_argument(
        "--verify-share",
        type=float,
        default=1.0,
        help="share of successful Ranks checked against full inference",
    )
    parser.add_argument("--ranker-down", type=float, default=10.0, help="seconds left dead")
    parser.add_argument("--etcd-down", type=float, default=15.0, help="seconds of etcd outage")
    parser.add_argument("--slow-for", type=float, default=30.0, help="seconds of slowness")
    parser.add_argument("--stopped", type=float, default=0.3, help="frozen seconds per period")
    parser.add_argument("--period", type=float, default=1.0, help="freeze period, seconds")
    parser.add_argument(
        "--freeze", type=float, default=8.0, help="then one freeze this long (0: none)"
    )
    parser.add_argument(
        "--flood-duration", type=float, default=60.0, help="seconds of the memory flood"
    )
    parser.add_argument(
        "--flood-concurrency", type=int, default=8, help="flood RPCs in flight at once"
    )
    parser.add_argument(
        "--overhead-mb",
        type=float,
        default=FloodSettings().overhead_mb,
        help="RSS a ranker may add beyond its KV tier budgets in the flood, MiB",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=int.from_bytes(os.urandom(4), "little"),
        help="workload seed (default: random)",
    )
    parser.add_argument("--quick", action="store_true", help="the CI test's sizes")
    add_render_arguments(parser)
    parser.add_argument("--tag", default="", help="results and doc section get _TAG")
    args = parser.parse_args()
    if args.from_json is not None:
        saved = load_result(args.from_json)
    else:
        if args.quick:
            args.rate, args.before, args.after = 10.0, 1.0, 3.0
            args.ranker_down, args.etcd_down, args.slow_for, args.freeze = 1.0, 2.5, 3.0, 0.0
            args.flood_duration = 6.0
        saved = run(args)
    text = render(saved)
    print(text)
    if not args.no_docs and not saved["args"]["quick"]:
        name = result_name(NAME, argparse.Namespace(**saved["args"]))
        for doc in ("benchmarks.md", "reliability.md"):
            write_section(ROOT / "docs" / doc, name, text)
    ok = all(FaultReport(**r).passed for r in saved["faults"])
    ok = ok and not any(w["violations"] for w in saved["flood"]["rankers"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
