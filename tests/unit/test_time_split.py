"""The simulator's speed reading splits its time between the services' own code and the
drivers: a library function's time goes to whoever called it, so a builtin the core calls a
million times counts for the core, not for nobody."""

from pathlib import Path

from bench.time_split import DRIVER, LIBRARY, SERVICES, floor_of, profiled, split

ROOT = Path("/repo")


def test_each_function_s_own_time_counts_for_its_floor_and_a_library_s_for_its_callers() -> None:
    core = ("/repo/services/ranker/core.py", 10, "step_done")
    placement = ("/repo/relaygr/placement.py", 5, "ranking")
    driver = ("/repo/tooling/sim/ranker.py", 20, "_apply")
    builtin = ("~", 0, "<built-in method builtins.max>")
    stdlib = ("/usr/lib/python3.11/dataclasses.py", 1, "replace")
    rows = {
        core: (5, 5, 2.0, 9.0, {driver: (5, 5, 2.0, 9.0)}),
        placement: (3, 3, 1.5, 2.0, {core: (3, 3, 1.5, 2.0)}),
        driver: (4, 4, 3.0, 12.0, {}),
        # max: 0.25 s of its calls from the core, 0.5 s from the driver, 0.125 s from replace
        builtin: (9, 9, 0.875, 0.875, {core: (2, 2, 0.25, 0.25), driver: (6, 6, 0.5, 0.5),
                                       stdlib: (1, 1, 0.125, 0.125)}),
        stdlib: (1, 1, 0.75, 0.875, {core: (1, 1, 0.75, 0.875)}),
    }  # fmt: skip
    assert split(rows, ROOT) == {SERVICES: 2.0 + 1.5 + 0.25 + 0.75, DRIVER: 3.5, LIBRARY: 0.125}


def test_only_the_repository_s_own_floors_are_its_code() -> None:
    assert floor_of("/repo/services/trigger/policy.py", ROOT) == SERVICES
    assert floor_of("/repo/relaygr/room.py", ROOT) == SERVICES
    assert floor_of("/repo/bench/sim_speed.py", ROOT) == DRIVER
    assert floor_of("/repo/tooling/sim/fleet.py", ROOT) == DRIVER
    assert floor_of("/repo/.venv/lib/python3.11/site-packages/numpy/core.py", ROOT) is None
    assert floor_of("/repo/tests/unit/test_time_split.py", ROOT) is None
    assert floor_of("/usr/lib/python3.11/heapq.py", ROOT) is None


def test_a_profiled_call_returns_its_result_and_the_time_of_its_calls() -> None:
    def negated(i: int) -> int:
        return -i

    result, seconds, calls = profiled(lambda: [negated(i) for i in range(100_000)])
    assert result[-1] == -99_999
    assert calls >= 100_000  # `negated`, once per item
    assert seconds[SERVICES] == 0.0  # no services' code ran
    assert seconds[DRIVER] + seconds[LIBRARY] > 0.0
