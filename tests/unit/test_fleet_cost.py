"""The fleet-cost benchmark (bench/fleet_cost.py): every kind timed at every size, rendered."""

import random

from bench.fleet_cost import KINDS, one_repeat, parse, render


def test_a_tiny_run_times_every_kind_at_every_size_and_renders() -> None:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    args = parse(["--quick", "--seed", str(seed), "--sizes", "3", "30"])
    rng = random.Random(seed)
    rows = []
    for size in args.sizes:
        users = [f"user-{size}-{i}" for i in range(50)]
        times = one_repeat(size, users, rng)
        assert set(times) == set(KINDS)
        assert all(us > 0 for us in times.values())
        rows += [{"rankers": size, "repeat": 0, "kind": k, "us": us} for k, us in times.items()]
    machine = {"date": "today", "commit": "abc", "machine": "here"}
    saved = {"command": "fleet_cost", "args": vars(args), "machine": machine, "rows": rows}
    text = render(saved)
    for kind in KINDS:
        assert f"| {kind} |" in text
    assert "| per call | 3 rankers | 30 rankers |" in text
