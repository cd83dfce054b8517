"""The local mesh's share of the CPUs for each ranker (no processes started)."""

import pytest

from relaygr.local.mesh import ranker_thread_share

BASE = ("--device", "cpu")


@pytest.mark.parametrize(
    ("rankers", "cpus", "share"),
    [(2, 2, 1), (2, 8, 4), (3, 8, 2), (4, 2, 1), (1, 6, 6), (1, 1, 1)],
)
def test_each_ranker_gets_its_fair_share(rankers: int, cpus: int, share: int) -> None:
    args, threads = ranker_thread_share(BASE, rankers, cpus)
    assert threads == share
    assert args == (*BASE, "--threads", str(share))


@pytest.mark.parametrize(
    ("given", "threads"),
    [
        (("--threads", "3"), 3),
        (("--threads=5",), 5),
        (("--threads", "1", "--threads=2"), 2),  # argparse keeps the last
        (("--threads=0",), 8),  # auto: the ranker's own quota, this machine's CPUs
    ],
)
def test_callers_threads_stand_as_given(given: tuple[str, ...], threads: int) -> None:
    args, used = ranker_thread_share((*BASE, *given), 2, 8)
    assert args == (*BASE, *given)
    assert used == threads


def test_a_similar_flag_is_not_mistaken_for_threads() -> None:
    args, used = ranker_thread_share(("--threads-per-core=9",), 2, 8)
    assert used == 4 and args[-2:] == ("--threads", "4")
