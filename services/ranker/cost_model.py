"""Calibration of a ranker's latency model (`relaygr.cost.CostModel`) at start-up."""

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from relaygr.behaviours import Behaviours, Prefix, UserId
from relaygr.cost import CallShape, CostModel
from services.ranker.cost_fit import BatchSample, Sample, fit_batch_saving, fit_cost_model
from services.ranker.model import RankingModel, RankItem
from services.ranker.prefix_kv import PrefixKV
from services.ranker.synthetic import random_behaviours

__all__ = [
    "BatchSample",
    "Sample",
    "calibrate",
    "fit_batch_saving",
    "fit_cost_model",
    "measure",
    "measure_batches",
]

Timer = Callable[[], float]

# Short-term behaviours in calibration's second cached Rank (the workloads served send tens to
# a few hundred).
_CALIBRATION_SHORT_TERM = 128


def measure(
    model: RankingModel,
    lengths: Sequence[int],
    candidates: int,
    chunk_tokens: int = 512,
    repeats: int = 3,
    timer: Timer = time.perf_counter,
) -> list[Sample]:
    """Time, on this device, the work of a miss as the engine serves it at each of `lengths`:
    chunked prefill, then ranking `candidates` on the prefix. Returns per length the median
    prefill (candidates 0) and the median prefill + rank (a full inference); and, for the
    cached-rank terms, the median of two Ranks on that prefix as cached ranks: `candidates`
    with no short-term behaviours, and twice as many (at most the model's limit) after
    `_CALIBRATION_SHORT_TERM` short-term behaviours, fewer where the history limit leaves less
    room (rows and keys both vary, so the fit can tell their terms apart).

    Rounds interleave the lengths, so a burst of load elsewhere on the host slows one run of
    several lengths rather than every run of one: the median drops it. Lengths beyond the
    model's history limit are clamped to it.
    """
    cfg = model.cfg
    lengths = sorted({min(max(1, n), cfg.max_history_tokens) for n in lengths})
    candidates = min(candidates, cfg.max_candidates)
    wide = min(2 * candidates, cfg.max_candidates)
    rng = np.random.default_rng(0)
    items = rng.integers(0, 1 << 40, candidates)
    prefixes = {
        n: Prefix(
            UserId("calibration"),
            np.zeros(0, np.int64),
            random_behaviours(rng, n, 1_700_000_000, 60 * n, cfg.num_actions),
        )
        for n in lengths
    }
    wide_items = rng.integers(0, 1 << 40, wide)
    short = random_behaviours(
        rng, _CALIBRATION_SHORT_TERM, 1_790_000_000, 60 * _CALIBRATION_SHORT_TERM,
        cfg.num_actions,
    )  # fmt: skip
    # Within the model's history limit: a prefix at the limit takes no short-term behaviours.
    shorts = {n: short.slice(0, min(len(short), cfg.max_history_tokens - n)) for n in lengths}

    def timed(fn: Callable[[], PrefixKV | torch.Tensor]) -> tuple[float, PrefixKV | torch.Tensor]:
        start = timer()
        out = fn()
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        return (timer() - start) * 1e3, out

    def run(n: int) -> tuple[float, float, float]:
        prefill_ms, kv = timed(lambda: _chunked_prefill(model, prefixes[n], chunk_tokens))
        assert isinstance(kv, PrefixKV)
        rank_ms, _ = timed(lambda: model.rank(kv, Behaviours.empty(), items, 1_800_000_000))
        wide_ms, _ = timed(lambda: model.rank(kv, shorts[n], wide_items, 1_800_000_000))
        return prefill_ms, rank_ms, wide_ms

    for n in {lengths[0], lengths[-1]}:  # warm-up: first calls and the largest buffers
        run(n)
    runs: dict[int, list[tuple[float, float, float]]] = {n: [] for n in lengths}
    for _ in range(max(1, repeats)):
        for n in lengths:
            runs[n].append(run(n))
    samples = []
    for n, timings in runs.items():
        samples.append(Sample(n, 0, statistics.median(p for p, _, _ in timings)))
        samples.append(Sample(n, candidates, statistics.median(p + r for p, r, _ in timings)))
        samples.append(Sample(n, candidates, statistics.median(r for _, r, _ in timings), n))
        wide_ms = statistics.median(w for _, _, w in timings)
        samples.append(Sample(n + len(shorts[n]), wide, wide_ms, n))
    return samples


def calibrate(
    model: RankingModel,
    lengths: Sequence[int],
    candidates: int,
    timer: Timer = time.perf_counter,
    repeats: int = 3,
    chunk_tokens: int = 512,
) -> CostModel:
    """Time full inference and prefill on this device at `lengths` and fit the cost model."""
    samples = measure(model, lengths, candidates, chunk_tokens, repeats, timer)
    cost = fit_cost_model(samples, reload_ms_per_mb=reload_ms_per_mb(model.device, timer))
    batches = measure_batches(model, (min(lengths), max(lengths)), candidates, repeats=repeats)
    return fit_batch_saving(cost, batches)


def measure_batches(
    model: RankingModel,
    lengths: Sequence[int],
    candidates: int,
    batch: int = 4,
    repeats: int = 3,
    timer: Timer = time.perf_counter,
) -> list[BatchSample]:
    """Time, on this device, `batch` cached Ranks (a prefix of each of `lengths`, `candidates`
    each) as one `rank_batch` call and as single calls back to back, `repeats` rounds that
    interleave the lengths. One sample per length and round. Prefills are untimed; lengths
    beyond the model's history limit are clamped to it.
    """
    cfg = model.cfg
    lengths = sorted({min(max(1, n), cfg.max_history_tokens) for n in lengths})
    candidates = min(max(1, candidates), cfg.max_candidates)
    rng = np.random.default_rng(1)
    users: dict[int, list[RankItem]] = {}
    for n in lengths:
        users[n] = []
        for i in range(batch):
            prefix = Prefix(
                UserId(f"calibration-{i}"),
                np.zeros(0, np.int64),
                random_behaviours(rng, n, 1_700_000_000, 60 * n, cfg.num_actions),
            )
            items = rng.integers(0, 1 << 40, candidates)
            users[n].append(
                RankItem(model.prefill(prefix), Behaviours.empty(), items, 1_800_000_000)
            )

    def timed(fn: Callable[[], object]) -> float:
        start = timer()
        fn()
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        return (timer() - start) * 1e3

    def singles(items: list[RankItem]) -> None:
        for item in items:
            model.rank_batch([item])

    for n in lengths[:1]:  # warm-up: first calls and buffers
        singles(users[n])
        model.rank_batch(users[n])
    samples = []
    for _ in range(max(1, repeats)):
        for n in lengths:
            alone = timed(lambda: singles(users[n]))  # noqa: B023 (called at once)
            together = timed(lambda: model.rank_batch(users[n]))  # noqa: B023
            shape = CallShape(n, 0, candidates)
            samples.append(BatchSample((shape,) * batch, together, alone))
    return samples


def _chunked_prefill(model: RankingModel, prefix: Prefix, chunk: int) -> PrefixKV:
    """The prefix computed as the engine's background prefill computes it: a first chunk of
    `chunk` tokens (user features included), then extensions of `chunk` behaviours."""
    first = max(chunk - len(prefix.user_features), 0)
    head = Prefix(prefix.user_id, prefix.user_features, prefix.long_term.slice(0, first))
    kv = model.prefill(head)
    for begin in range(first, len(prefix.long_term), chunk):
        kv = model.extend(kv, prefix.long_term.slice(begin, begin + chunk))
    return kv


def reload_ms_per_mb(device: torch.device, timer: Timer = time.perf_counter) -> float:
    """Host-to-device copy time per MiB (a host memcpy when the device is the CPU)."""
    host = torch.empty(16 * 2**20, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    times = []
    for _ in range(5):
        start = timer()
        host.to(device, copy=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((timer() - start) * 1e3)
    return statistics.median(times) / 16
