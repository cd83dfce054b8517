"""In-process relay demo: pre-infer a user's prefix, then rank against it, versus full inference.

The mesh demo (separate trigger, router and ranker processes) replaces this once those services
exist; the comparison it prints is the same question: what does the ranking stage pay?
"""

import argparse
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from relaygr.ranker.inputs import Prefix, RankInput, UserId
from relaygr.ranker.model import RankingModel
from relaygr.ranker.model_config import ModelConfig
from relaygr.ranker.synthetic import random_behaviours

SHORT_TERM = 128
CANDIDATES = 256
USER_FEATURES = 8
T0 = 1_700_000_000


def _request(rng: np.random.Generator, n_long: int) -> RankInput:
    prefix = Prefix(
        UserId(f"user-{n_long}"),
        rng.integers(0, 1 << 40, USER_FEATURES),
        random_behaviours(rng, n_long, T0, 10**8),
    )
    short = random_behaviours(rng, SHORT_TERM, T0 + 10**8, 3600)
    return RankInput(prefix, short, rng.integers(0, 1 << 50, CANDIDATES), T0 + 10**8 + 3600)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relaygr demo", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two short prefixes (for CI)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or npu")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: random)")
    args = parser.parse_args(argv)

    seed = args.seed if args.seed is not None else secrets.randbelow(2**32)
    rng = np.random.default_rng(seed)
    lengths = [512, 2048] if args.quick else [1024, 2048, 4096, 8192]
    model = RankingModel(ModelConfig(), seed=0, device=args.device)
    print(f"RelayGR in-process relay demo: model {model.model_version} on {model.device}")
    print(
        f"{SHORT_TERM} short-term behaviours, {CANDIDATES} candidates, "
        f"{torch.get_num_threads()} threads, input seed {seed}\n"
    )
    header = (
        f"{'prefix':>7} {'pre-infer ms':>13} {'rank ms':>9} {'full ms':>9} "
        f"{'speed-up':>9} {'KV MB':>7} {'max rel err':>12}"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for n_long in lengths:
        request = _request(rng, n_long)
        kv = model.prefill(request.prefix)  # warm-up, and the cache the ranking stage consumes
        prefill_ms = _median_ms(partial(model.prefill, request.prefix), 1)

        def cached(kv=kv, r=request) -> torch.Tensor:
            return model.rank(kv, r.short_term, r.candidates, r.request_ts)

        def full(r=request) -> torch.Tensor:
            return model.full_forward(r)

        error = float((cached() - full()).abs().max() / full().abs().max())
        worst = max(worst, error)
        rank_ms = _median_ms(cached, args.repeats)
        full_ms = _median_ms(full, args.repeats)
        print(
            f"{n_long + USER_FEATURES:>7} {prefill_ms:>13.1f} {rank_ms:>9.1f} {full_ms:>9.1f} "
            f"{full_ms / rank_ms:>8.1f}x {kv.nbytes / 2**20:>7.1f} {error:>12.1e}",
            flush=True,
        )
    print(
        "\npre-infer runs at retrieval time, off the ranking path; the ranking stage pays "
        "'rank ms' with the relay and 'full ms' without it."
    )
    if worst > 1e-5:
        print(f"exactness violated: relative error {worst:.2e} > 1e-5", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
