"""Verdicts over repeated runs: compliant throughput per SLO, longest sequence, median and spread,
bootstrap intervals, ratios paired per seed, and the one wording of a P99 verdict.

Pure: takes measured points (anything with rate, p99 and errors) or latencies, returns numbers and
text. The benchmarks and their tests use it; nothing here starts a process.

Rules every benchmark follows (docs/benchmarks.md, "Reading the numbers"): a P99 verdict on the
mesh needs `MIN_RANKS` Ranks in its point, else it is printed as indicative with its n; a
simulated comparison needs `MIN_SIM_SEEDS` seeds, else it is labelled indicative; a P99 carries a
bootstrap 95% interval; ratios between two variants are taken per seed (both ran the same trace).
"""

import argparse
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bench.report import RatePoint, max_compliant
from tooling.local.search import grid_search, scan_search

__all__ = [
    "MIN_RANKS",
    "MIN_SIM_SEEDS",
    "Interval",
    "PairedRatios",
    "Spread",
    "add_seeds_rule",
    "bootstrap",
    "check_seeds",
    "compliant_throughput",
    "grid_search",
    "labelled",
    "p99_ci",
    "p99_interval",
    "p99_verdict",
    "ranks_note",
    "scan_search",
    "seeds_note",
    "verdict_word",
]

# Below this many Ranks a point's P99 is its slowest one to three Ranks: no pass or fail on it.
MIN_RANKS = 300
# Below this many seeds a simulated comparison is one draw of the workload, not a verdict.
MIN_SIM_SEEDS = 5
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # fixed: the same file always renders the same interval


@dataclass(frozen=True, slots=True)
class Interval:
    """A statistic with its bootstrap interval (`level`, percentile method) over `n` values."""

    value: float
    low: float
    high: float
    n: int
    level: float = 0.95

    def text(self, unit: str = "", fmt: str = ".0f") -> str:
        return (
            f"{self.value:{fmt}}{unit} [{self.low:{fmt}}-{self.high:{fmt}}{unit}, "
            f"{self.level:.0%} CI, n={self.n}]"
        )


def bootstrap(
    values: Sequence[float],
    statistic: Callable[[np.ndarray], float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    level: float = 0.95,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """`statistic` of `values` with a percentile bootstrap interval: `resamples` draws with
    replacement, seeded so that the interval is a function of the values alone."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        nan = float("nan")
        return Interval(nan, nan, nan, 0, level)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, data.size, size=(resamples, data.size))
    stats = np.array([statistic(data[row]) for row in draws])
    tail = (1 - level) / 2
    low, high = np.quantile(stats, [tail, 1 - tail])
    return Interval(float(statistic(data)), float(low), float(high), int(data.size), level)


def _p99(data: np.ndarray) -> float:
    return float(np.percentile(data, 99))


def p99_interval(latencies_ms: Sequence[float], seed: int = BOOTSTRAP_SEED) -> Interval:
    """A point's P99 (numpy's linear percentile, as `Point.of`) with its bootstrap 95% interval."""
    return bootstrap(latencies_ms, _p99, seed=seed)


def p99_ci(latencies_ms: Sequence[float]) -> str:
    """A table cell: the P99's bootstrap 95% interval in ms ("812-905"), "-" for a point saved
    without its latencies (runs before issue 28)."""
    if not latencies_ms:
        return "-"
    interval = p99_interval(latencies_ms)
    return f"{interval.low:.0f}-{interval.high:.0f}"


def verdict_word(passed: bool, n: int, minimum: int = MIN_RANKS, unit: str = "n") -> str:
    """ "pass" or "fail" on at least `minimum` samples; below that "indicative (n=N)", whichever
    way the figure fell. The one wording of a P99 verdict (and, with unit="seeds", of a
    simulated comparison)."""
    if n < minimum:
        return f"indicative ({unit}={n})"
    return "pass" if passed else "fail"


def p99_verdict(latencies_ms: Sequence[float], slo_ms: float, minimum: int = MIN_RANKS) -> str:
    """A point's P99 against `slo_ms`, worded: "pass: P99 812 ms [790-840 ms, 95% CI, n=412]";
    under `minimum` Ranks "indicative (n=42): P99 ..." (never pass or fail)."""
    interval = p99_interval(latencies_ms)
    word = verdict_word(interval.value <= slo_ms, interval.n, minimum)
    return f"{word}: P99 {interval.text(' ms')} against {slo_ms:g} ms"


def ranks_note(ns: Iterable[int], minimum: int = MIN_RANKS, per: str = "point") -> str:
    """Empty when every point counted has `minimum` Ranks; else the label a figure resting on
    their P99s carries: "indicative (n=28-60 Ranks a point, under 300)"."""
    counts = sorted(ns)
    if not counts or counts[0] >= minimum:
        return ""
    span = f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
    return f"indicative (n={span} Ranks a {per}, under {minimum})"


def labelled(note: str) -> str:
    """A note as the bold sentence that follows a figure (" **Indicative (...).**"), "" for none."""
    return f" **{note[:1].upper()}{note[1:]}.**" if note else ""


def seeds_note(seeds: int, minimum: int = MIN_SIM_SEEDS) -> str:
    """Empty with `minimum` seeds or more; else "indicative (seeds=N, under 5)"."""
    return "" if seeds >= minimum else f"indicative (seeds={seeds}, under {minimum})"


def add_seeds_rule(parser: argparse.ArgumentParser) -> None:
    """--indicative: the one way to run a simulated comparison on fewer than MIN_SIM_SEEDS seeds
    (see `check_seeds`)."""
    parser.add_argument(
        "--indicative",
        action="store_true",
        help=f"allow fewer than {MIN_SIM_SEEDS} seeds; the comparison is labelled indicative",
    )


def check_seeds(parser: argparse.ArgumentParser, args: argparse.Namespace, seeds: int) -> None:
    """Refuse a simulated comparison on fewer than MIN_SIM_SEEDS seeds unless it is a smoke run
    (--quick), asked for as indicative (--indicative) or only re-rendered (--from-json)."""
    if seeds >= MIN_SIM_SEEDS or args.quick or args.indicative or args.from_json is not None:
        return
    parser.error(
        f"{seeds} seed(s): a simulated comparison needs at least {MIN_SIM_SEEDS} "
        "(pass --indicative to run it anyway, labelled indicative)"
    )


@dataclass(frozen=True, slots=True)
class PairedRatios:
    """Per-seed ratios `a[s] / b[s]` of two variants that ran the same traces: their range and
    the median ratio with a bootstrap 95% interval (over seeds). Seeds where `b` is zero or
    missing are counted in `undefined`, not divided."""

    ratios: dict[int, float]
    median: Interval
    undefined: int

    @classmethod
    def of(
        cls, a: Mapping[int, float], b: Mapping[int, float], seed: int = BOOTSTRAP_SEED
    ) -> "PairedRatios":
        ratios = {s: a[s] / b[s] for s in sorted(a) if b.get(s, 0) > 0}
        undefined = sum(1 for s in a if b.get(s, 0) <= 0)
        median = bootstrap(list(ratios.values()), lambda d: float(np.median(d)), seed=seed)
        return cls(ratios, median, undefined)

    @property
    def low(self) -> float:
        return min(self.ratios.values(), default=float("nan"))

    @property
    def high(self) -> float:
        return max(self.ratios.values(), default=float("nan"))

    def text(self) -> str:
        """ "1.7x (per seed 1.4-1.8x; median's 95% CI 1.4-1.8x, 3 seeds)"."""
        if not self.ratios:
            return "-"
        m = self.median
        return (
            f"{m.value:.2g}x (per seed {self.low:.2g}-{self.high:.2g}x; median's 95% CI "
            f"{m.low:.2g}-{m.high:.2g}x, {m.n} seeds)"
        )


@dataclass(frozen=True, slots=True)
class Spread:
    """The median of a figure over seeds, and its range."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not values:
            return cls(0.0, 0.0, 0.0, 0)
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, unit: str = "") -> str:
        if self.n <= 1 or self.low == self.high:
            return f"{self.median:g}{unit}"
        return f"{self.median:g}{unit} [{self.low:g}-{self.high:g}]"


def compliant_throughput(per_seed: Mapping[int, Iterable[RatePoint]], slo_ms: float) -> Spread:
    """Over seeds: the highest rate below which every point met `slo_ms` (P99, no failure)."""
    return Spread.of([max_compliant(list(points), slo_ms) for points in per_seed.values()])
