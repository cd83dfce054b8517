"""Simulated runs side by side in worker processes: each run is independent of the others and
single-threaded, so a search's runs at one step (a trial's seeds) can use every CPU it is given.

The workers are forked with the evaluator installed, so nothing of it (its spec, a trace, the
visits it keeps) is pickled; each run's result comes back pickled, in the order asked.
"""

import argparse
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

from relaygr.bounds import AT_LEAST_ONE, Bounded
from relaygr.cpu_quota import available_cpus

R = TypeVar("R")

_installed: Callable[..., Any] | None = None  # a worker's evaluator, set as it starts


def _install(evaluate: Callable[..., Any]) -> None:
    global _installed
    _installed = evaluate


def _call(args: tuple[Any, ...]) -> Any:
    assert _installed is not None, "a worker evaluates only once installed"
    return _installed(*args)


def add_jobs_arg(group: argparse._ArgumentGroup, what: str) -> None:
    """The `--jobs` option of a command whose `what` run side by side (`jobs_for` reads it)."""
    group.add_argument(
        "--jobs",
        type=Bounded(int, AT_LEAST_ONE),
        help=f"{what} at once, each in a process of its own (default: the CPUs this process "
        "may use); the results are the same whatever the count",
    )


def jobs_for(asked: int | None, most: int) -> int:
    """Workers for `most` runs at a time: as asked, else the CPUs this process may use (cgroup
    quota included), never more than `most`."""
    return max(1, min(asked or available_cpus(), most))


class Processes(Generic[R]):
    """`evaluate` over many argument tuples at once in `jobs` forked workers (one, or a platform
    without fork: in this process, one after another). `width` is how many runs it takes at
    once."""

    def __init__(self, evaluate: Callable[..., R], jobs: int) -> None:
        self._evaluate = evaluate
        forks = "fork" in multiprocessing.get_all_start_methods()
        self.width = max(1, jobs) if forks else 1
        self._pool = None
        if self.width > 1:
            context = multiprocessing.get_context("fork")
            self._pool = context.Pool(self.width, initializer=_install, initargs=(evaluate,))

    def __call__(self, asks: Sequence[tuple[Any, ...]]) -> list[R]:
        """The runs of `asks`, in their order."""
        return list(self.each(asks))

    def each(self, asks: Sequence[tuple[Any, ...]]) -> Iterator[R]:
        """The runs of `asks` one by one, in their order, each as soon as it and those before
        it are done."""
        if self._pool is None or len(asks) < 2:
            return (self._evaluate(*args) for args in asks)
        return self._pool.imap(_call, asks, chunksize=1)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> "Processes[R]":
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._pool is not None and error is not None:
            self._pool.terminate()
        self.close()
