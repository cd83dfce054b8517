"""The local mesh's share of the CPUs for each ranker, and `relaygr up`'s options (no processes
started)."""

import pytest

from tooling.local.mesh import ranker_thread_share
from tooling.local.up import join_pass_through, parser

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


@pytest.mark.parametrize(
    ("argv", "ranker_args"),
    [
        (["--ranker-arg", "--device=cpu"], ["--device=cpu"]),
        (["--ranker-arg=--device=cpu"], ["--device=cpu"]),
        (["--ranker-arg", "--device", "--ranker-arg", "cpu"], ["--device", "cpu"]),
        (["--ranker-arg", "-v", "--rankers", "3"], ["-v"]),
    ],
)
def test_a_pass_through_flag_may_follow_its_option_as_its_own_token(
    argv: list[str], ranker_args: list[str]
) -> None:
    args = parser().parse_args(join_pass_through(argv))
    assert args.ranker_arg == ranker_args
    assert args.router_arg == [] and args.trigger_arg == []


def test_only_pass_through_options_are_joined() -> None:
    argv = ["--rankers", "3", "--router-arg", "--rank-hedge-ms=50", "--tls", "--trigger-arg"]
    joined = join_pass_through(argv)
    assert joined == ["--rankers", "3", "--router-arg=--rank-hedge-ms=50", "--tls", "--trigger-arg"]


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (["--rankers", "0"], "argument --rankers: must be >= 1, got 0"),
        (["--metrics-base-port", "70000"], "must be in [0, 65535] (0: none), got 70000"),
        (["--model", "huge"], "invalid choice: 'huge'"),
    ],
)
def test_up_refuses_an_option_out_of_its_range(
    argv: list[str], refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(argv)
    assert refusal in capsys.readouterr().err


def test_up_help_states_each_range_and_default() -> None:
    text = " ".join(parser().format_help().split())
    assert "--rankers N rankers (>= 1; default: 2)" in text
    assert "(in [0, 65535], 0: none; default: 0)" in text
    assert "--ranker-arg --device=cpu" in text and "processes.json" in text
