"""Every figure the README's headline quotes is marked and matches its result file.

A figure is written `<!-- figure:NAME -->TEXT<!-- /figure -->` (the comments do not render);
FIGURES says how NAME is computed from which file in bench/results/. A marked figure that this
test does not know, or a known one the README no longer marks, fails too, so that neither side
drifts alone.
"""

import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.relay_bench import BASELINES, RELAYS, best_of, load_points, of_label, per_seed_figure
from bench.verdict import PairedRatios, Spread, compliant_throughput
from tooling.local.compliance import max_compliant

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"
MARKED = re.compile(r"<!-- figure:([\w.]+) -->(.*?)<!-- /figure -->", re.S)

Saved = dict[str, Any]


def load(name: str) -> Saved:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _relay_lengths(saved: Saved) -> tuple[dict, str, str]:
    """Per label, per seed, the longest sequence within the SLO; and the best relay and the best
    baseline by median (as bench/relay_bench.py's headline picks them)."""
    slo = saved["args"]["slo_ms"]
    per_seed = load_points(saved)
    lengths = {v: of_label(per_seed, "lengths", v) for v in (*RELAYS, *BASELINES)}
    figure = {v: per_seed_figure(ls, slo) for v, ls in lengths.items() if any(ls.values())}
    spread = {v: Spread.of(list(f.values())) for v, f in figure.items()}
    relay, base = best_of(RELAYS, spread), best_of(BASELINES, spread)
    assert relay and base
    return {"figure": figure, "lengths": lengths}, relay, base


def relay_longest_ratio(saved: Saved) -> Spread:
    found, relay, base = _relay_lengths(saved)
    paired = PairedRatios.of(found["figure"][relay], found["figure"][base])
    return Spread.of([round(r, 1) for r in paired.ratios.values()])


def relay_longest_n(saved: Saved) -> str:
    found, relay, base = _relay_lengths(saved)
    ns = sorted(p.ok for v in (relay, base) for ps in found["lengths"][v].values() for p in ps)
    return f"{ns[0]}-{ns[-1]}"


def relay_compliant(saved: Saved, labels: tuple[str, ...]) -> dict[str, Spread]:
    slo = saved["args"]["slo_ms"]
    per_seed = load_points(saved)
    return {v: compliant_throughput(of_label(per_seed, "rates", v), slo) for v in labels}


def sim_per_seed(saved: Saved, variant: str) -> list[float]:
    slo = saved["args"]["slo_ms"]
    return [
        max_compliant(
            [_Rate(p) for p in saved["sweep"] if p["variant"] == variant and p["seed"] == s], slo
        )
        for s in saved["seeds"]
    ]


class _Rate:
    def __init__(self, raw: dict) -> None:
        self.rate, self.p99_ms, self.errors = raw["rate"], raw["p99_ms"], raw["errors"]


def sim_longest_ratio(saved: Saved) -> str:
    slo = saved["args"]["slo_ms"]

    def longest(variants: tuple[str, ...], seed: int) -> int:
        ok = [
            p["length"]
            for p in saved["lengths"]
            if p["variant"] in variants and p["seed"] == seed
            and not p["errors"] and p["p99_ms"] <= slo
        ]  # fmt: skip
        return max(ok, default=0)

    ratios = [longest(RELAYS, s) / longest(BASELINES, s) for s in saved["seeds"]]
    return f"{statistics.median(ratios):.2f}x"


def plan_slice(saved: Saved) -> list[dict]:
    return saved["plan"]["slice_check"]


def plan_slice_p99(saved: Saved) -> str:
    """How far the slice's P99 read from the whole fleet's, per seed: "A-B% low", "A-B% high",
    or "A% low to B% high"."""
    off = sorted(
        round(100 * (c["slice"]["p99_ms"] / c["whole"]["p99_ms"] - 1)) for c in plan_slice(saved)
    )
    if off[-1] <= 0:
        return f"{-off[-1]}-{-off[0]}% low"
    if off[0] >= 0:
        return f"{off[0]}-{off[-1]}% high"
    return f"{-off[0]}% low to {off[-1]}% high"


def plan_slice_hits_points(saved: Saved) -> str:
    gap = max(abs(c["slice"]["hit_ratio"] - c["whole"]["hit_ratio"]) for c in plan_slice(saved))
    return f"{-(-gap * 100 // 1):.0f}"  # within this many points, rounded up


FIGURES: dict[str, tuple[str, Callable[[Saved], str]]] = {
    "relay.users": ("relay_bench", lambda s: f"{s['population']['users']:,}"),
    "relay.seeds": ("relay_bench", lambda s: str(len(s["seeds"]))),
    "relay.slo_s": ("relay_bench", lambda s: f"{s['args']['slo_ms'] / 1e3:g}"),
    "relay.commit": ("relay_bench", lambda s: s["machine"]["commit"][:7]),
    "relay.longest_ratio": ("relay_bench", lambda s: f"{relay_longest_ratio(s).median:g}x"),
    "relay.longest_range": (
        "relay_bench",
        lambda s: f"{relay_longest_ratio(s).low:g}-{relay_longest_ratio(s).high:g}x",
    ),
    "relay.longest_n": ("relay_bench", relay_longest_n),
    "relay.cache_only_compliant": (
        "relay_bench",
        lambda s: f"{relay_compliant(s, ('cache only',))['cache only'].high:g}",
    ),
    "relay.relay_compliant": (
        "relay_bench",
        lambda s: f"{max(x.median for x in relay_compliant(s, RELAYS).values()):g}",
    ),
    "sim.slo_ms": ("sim_paper", lambda s: f"{s['args']['slo_ms']:g}"),
    "sim.seeds": ("sim_paper", lambda s: str(len(s["seeds"]))),
    "sim.relay_all_per_ranker": (
        "sim_paper",
        lambda s: f"{statistics.median(sim_per_seed(s, 'relay all')) / s['args']['rankers']:g}",
    ),
    "sim.longest_ratio": ("sim_paper", sim_longest_ratio),
    "plan.rankers": ("plan_bench", lambda s: str(s["plan"]["answer"]["rankers"])),
    "plan.slice_p99": ("plan_bench", plan_slice_p99),
    "plan.slice_hits_points": ("plan_bench", plan_slice_hits_points),
}


def marked() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name, text in MARKED.findall(README.read_text()):
        found.setdefault(name, []).append(" ".join(text.split()))
    return found


def test_every_marked_figure_is_known_and_every_known_one_is_marked() -> None:
    names = set(marked())
    assert names - FIGURES.keys() == set(), "README marks figures this test cannot check"
    assert FIGURES.keys() - names == set(), "figures no longer marked in README.md"


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_readme_figure_matches_its_result_file(name: str) -> None:
    result, compute = FIGURES[name]
    expected = compute(load(result))
    for text in marked().get(name, []):
        assert text == expected, (
            f"README.md quotes {name} as {text!r}; bench/results/{result}.json gives {expected!r}"
        )
