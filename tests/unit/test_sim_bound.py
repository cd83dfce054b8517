"""The references beside the trigger where the room or no-shows bind (bench/sim_bound.py): its
points, its systems, its per-seed ratios and a tiny run end to end."""

import math
import random

from bench.sim_bound import (
    AWARE,
    BEST_TOLD,
    SIZED,
    TOLD,
    bound_points,
    measure,
    over_all,
    render,
    systems_at,
)
from bench.sim_map import parse


def test_the_points_are_the_maps_where_the_room_or_no_shows_bind() -> None:
    labels = [p.label for p in bound_points()]
    assert labels == [
        "no_show=0.1", "no_show=0.3", "tier=binding", "tier=binding no_show=0.3",
        "tier=binding gap_ms=200",
    ]  # fmt: skip
    told = {p.label: any(k.endswith(TOLD) for k in systems_at(p)) for p in bound_points()}
    assert told == {
        "no_show=0.1": True, "no_show=0.3": True, "tier=binding": False,
        "tier=binding no_show=0.3": True, "tier=binding gap_ms=200": False,
    }  # fmt: skip


def test_ratios_are_per_seed_over_relay_all() -> None:
    by = {"relay all": {1: 10.0, 2: 0.0, 3: 0.0}, BEST_TOLD: {1: 14.0, 2: 5.0, 3: 0.0}}
    assert over_all(by, [1, 2, 3], BEST_TOLD) == [1.4, math.inf, None]


def test_a_tiny_run_measures_every_system_and_renders() -> None:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    args = parse(
        ["--quick", "--seed", str(seed), "--no-docs", "--points", "tier=binding no_show=0.3"]
    )
    args.duration, args.rate_max, args.length_max, args.users = 2.0, 20.0, 1024, 10_000
    results = measure(args)
    assert results["points"] == ["tier=binding no_show=0.3"]
    variants = {r["variant"] for r in results["rows"]}
    assert variants == {"relay all", AWARE, f"relay all{TOLD}", f"{AWARE}{TOLD}", SIZED}
    for row in results["rows"]:
        told = row["variant"].endswith(TOLD)
        assert ("oracle_no_show" in row["reasons"]) is told, row["variant"]
        assert row["values"]["tier"] == ("sized" if row["variant"] == SIZED else "binding")
    text = render({**results, "args": vars(args), "command": "sim_bound"})
    assert "| nvidia-h100 | tier=binding no_show=0.3 | " in text
    assert "seeds at target" in text
