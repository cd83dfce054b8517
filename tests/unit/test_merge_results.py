"""A benchmark run in parts joins into the result one run would have saved, or is refused.

The stored relay benchmark, cut into parts by seed and variant as sessions would run it, joins
back into a result whose docs section is the stored one's; parts that are not one comparison
(another commit, a dirty tree, other arguments, a variant of a seed run twice) are refused,
naming the part.
"""

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from bench import merge_results
from bench.merge_results import PartsDisagree, merge
from bench.relay_bench import render

ROOT = Path(__file__).resolve().parents[2]
STORED = json.loads((ROOT / "bench" / "results" / "relay_bench.json").read_text())
CLEAN = "0123456789abcdef0123456789abcdef01234567"


def part(seed: str, labels: list[str], date: str = "2026-12-06 01:00 UTC") -> dict[str, Any]:
    """The stored run's `labels` at `seed`, as a part run at CLEAN would have saved them."""
    saved = copy.deepcopy(STORED)
    variants = [v for v in saved["args"]["variants"] if v in labels]
    saved["args"].update(
        seed=int(seed),
        repeats=1,
        variants=variants,
        length_variants=[v for v in saved["args"]["length_variants"] if v in labels],
        tag=f"part-{seed}-{len(labels)}",
        no_docs=True,
    )
    saved["machine"].update(commit=CLEAN, date=date)
    saved["command"] = f".venv/bin/python bench/relay_bench.py --seed {seed} --repeats 1"
    saved["seeds"] = {
        seed: {
            key: [p for p in points if p["label"] in labels]
            for key, points in STORED["seeds"][seed].items()
        }
    }
    return saved


def paths(n: int) -> list[Path]:
    return [Path(f"bench/results/relay_bench_part{i}.json") for i in range(n)]


def cut() -> list[dict[str, Any]]:
    """Seed by seed, and the first seed variant by variant: the parts sessions would run."""
    seeds = list(STORED["seeds"])
    variants = STORED["args"]["variants"]
    firsts = [part(seeds[0], [v], f"2026-12-0{6 + i} 01:00 UTC") for i, v in enumerate(variants)]
    return firsts + [part(seed, variants, "2026-12-10 01:00 UTC") for seed in seeds[1:]]


def test_parts_cut_by_seed_and_variant_join_into_the_stored_comparison() -> None:
    parts = cut()
    joined = merge("relay_bench", paths(len(parts)), parts)
    assert list(joined["seeds"]) == list(STORED["seeds"])
    assert joined["args"]["seed"] == STORED["args"]["seed"]
    assert joined["args"]["repeats"] == len(STORED["seeds"])
    assert joined["args"]["variants"] == STORED["args"]["variants"]
    assert joined["args"]["length_variants"] == STORED["args"]["length_variants"]
    for seed, runs in STORED["seeds"].items():
        for key, points in runs.items():
            got = joined["seeds"][seed][key]
            assert sorted(map(json.dumps, got)) == sorted(map(json.dumps, points)), (seed, key)
    # The joined command runs every part, then the join; the stamp spans the parts' dates.
    assert joined["command"].split(" && ")[:-1] == [p["command"] for p in parts]
    assert joined["command"].endswith(" ".join(map(str, paths(len(parts)))))
    assert joined["machine"]["commit"] == CLEAN
    assert joined["machine"]["date"] == "2026-12-06 01:00 UTC to 2026-12-10 01:00 UTC"
    assert [p["file"] for p in joined["parts"]] == [p.name for p in paths(len(parts))]
    # What the docs show from it is what one run of the same points shows.
    one_run = {**copy.deepcopy(STORED), "command": joined["command"]}
    one_run["machine"] = joined["machine"]
    assert render(joined) == render(one_run)


@pytest.mark.parametrize(
    ("spoil", "named"),
    [
        (lambda p: p["machine"].update(commit=CLEAN + "-dirty"), "clean commit"),
        (lambda p: p["machine"].update(commit="f" * 40), "commit"),
        (lambda p: p["machine"].update(threads=2), "threads"),
        (lambda p: p["args"].update(rates=[*p["args"]["rates"], 99.0]), "rates"),
        (lambda p: p["population"].update(users=10), "population"),
    ],
    ids=["dirty", "another commit", "other threads", "other rates", "other population"],
)
def test_a_part_that_is_not_the_same_comparison_is_refused_by_name(spoil, named: str) -> None:
    parts = cut()
    spoil(parts[-1])
    with pytest.raises(PartsDisagree, match=named) as refused:
        merge("relay_bench", paths(len(parts)), parts)
    assert paths(len(parts))[-1].name in str(refused.value)


def test_a_sample_drawn_at_each_part_s_seed_joins_as_the_lowest_seed_s() -> None:
    # relay_bench samples the population's traffic at its first seed, so parts of other seeds
    # record other samples; the join keeps the one a single run from the lowest seed draws.
    parts = cut()
    for p in parts:
        seed = int(p["args"]["seed"])
        p["population"].update(sample_visits=seed % 97, sample_distinct_users=seed % 89)
    first_seed = min(int(p["args"]["seed"]) for p in parts)
    joined = merge("relay_bench", paths(len(parts)), parts)
    assert joined["population"]["sample_visits"] == first_seed % 97
    assert joined["population"]["sample_distinct_users"] == first_seed % 89
    assert joined["population"]["users"] == STORED["population"]["users"]
    # ...but the parts of one seed drew one sample, or they are not one run.
    parts[1]["population"]["sample_visits"] += 1
    assert parts[1]["args"]["seed"] == parts[0]["args"]["seed"]
    with pytest.raises(PartsDisagree, match="population") as refused:
        merge("relay_bench", paths(len(parts)), parts)
    assert paths(len(parts))[1].name in str(refused.value)
    assert "same seed" in str(refused.value)


def test_a_variant_of_a_seed_run_in_two_parts_is_refused() -> None:
    seed = next(iter(STORED["seeds"]))
    parts = [part(seed, ["cache only", "relay all"]), part(seed, ["relay all"])]
    with pytest.raises(PartsDisagree, match=f"seed {seed}, 'relay all'"):
        merge("relay_bench", paths(2), parts)


def test_the_join_writes_the_result_and_keeps_the_parts_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    monkeypatch.setattr(merge_results, "ROOT", tmp_path)
    files = []
    for i, saved in enumerate(cut()):
        files.append(results / f"relay_bench_part{i}.json")
        files[-1].write_text(json.dumps(saved))
    assert merge_results.main(["relay_bench", *map(str, files), "--tag", "joined"]) == 0
    joined = json.loads((results / "relay_bench_joined.json").read_text())
    assert len(joined["seeds"]) == len(STORED["seeds"])
    assert sorted(p.name for p in (results / "parts").iterdir()) == sorted(f.name for f in files)
    assert not any(f.exists() for f in files)
    # Refused: nothing written, nothing moved, exit 2.
    spoiled = cut()
    spoiled[0]["machine"]["commit"] += "-dirty"
    again = results / "again.json"
    again.write_text(json.dumps(spoiled[0]))
    assert merge_results.main(["relay_bench", str(again), "--tag", "x"]) == 2
    assert again.exists() and not (results / "relay_bench_x.json").exists()


def test_a_seed_whose_other_variant_has_not_run_yet_is_refused() -> None:
    seeds = list(STORED["seeds"])
    variants = STORED["args"]["variants"]
    parts = [part(seeds[0], variants), part(seeds[1], variants[:1])]
    with pytest.raises(PartsDisagree, match=f"seed {seeds[1]} lacks"):
        merge("relay_bench", paths(2), parts)


def test_a_result_of_another_benchmark_is_refused() -> None:
    with pytest.raises(PartsDisagree, match=r"not a result of bench/sim_map\.py"):
        merge("sim_map", paths(1), cut()[:1])
