"""Join the parts of one benchmark run into the result file its docs section renders from.

A mesh benchmark that takes longer than one quiet stretch of a machine runs in parts: its seeds
one at a time, or a seed's variants one at a time (`--seed S --repeats 1 --variants V`), each
with `--no-docs` and its own `--tag`, each saved to bench/results/. This joins them:

    .venv/bin/python bench/merge_results.py relay_bench bench/results/relay_bench_part*.json

and writes bench/results/relay_bench.json (`--tag T`: relay_bench_T.json), moving parts saved in
bench/results/ to bench/results/parts/ (only a result renders a docs section); then
`bench/relay_bench.py --from-json bench/results/relay_bench.json` renders its section.

Parts are joined only when the comparison stays one comparison: every part measured the same
clean commit on the same kind of machine with the same threads, with the same arguments but for
which seeds and variants it ran, each variant of each seed comes from one part, and every seed
has every variant. Everything
else a part records (the population, the rankers' threads) must agree, but for what a part draws
at its own first seed (`SEED_DRAWN`: the sample of the population's traffic), on which the parts
of one seed agree and the join keeps the lowest seed's. The joined file's command
runs every part and then this join; its stamp is the first part's, dated from the first part's
start to the last's, and each part's own stamp is kept under `parts` (by file name, in
bench/results/parts/).
"""

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.pipeline import ROOT, result_name
from bench.report import dumps_result

# Arguments a part may set on its own: which seeds and variants it ran, and how it was saved.
PER_PART = frozenset({"seed", "repeats", "variants", "length_variants", "tag", "no_docs"})
# What a result file holds besides what its parts ran.
RECORDS = frozenset({"command", "args", "machine", "seeds", "parts"})
# The stamp fields every part must share (the date is each part's own).
SHARED_STAMP = ("commit", "machine", "threads", "torch", "python")
# Fields of a record that a part draws at its own first seed (`args.seed`): relay_bench's sample
# of the population's traffic (`relay_bench.population_info`). Parts of one seed agree on them;
# the join keeps the lowest seed's, as one run starting there would have drawn them.
SEED_DRAWN: dict[str, frozenset[str]] = {
    "population": frozenset({"sample_visits", "sample_distinct_users"}),
}


class PartsDisagree(ValueError):
    """The parts are not one comparison; the message says which parts differ, and in what."""


def _label(point: dict[str, Any]) -> str:
    return str(point.get("label", ""))


def _check_stamps(names: Sequence[str], parts: Sequence[dict[str, Any]]) -> None:
    first = parts[0]["machine"]
    for name, part in zip(names, parts, strict=True):
        stamp = part["machine"]
        commit = str(stamp.get("commit", ""))
        if commit.endswith("-dirty") or "copied" in commit or commit in ("", "unknown"):
            raise PartsDisagree(f"{name} did not measure a clean commit ({commit or 'none'})")
        for field in SHARED_STAMP:
            if stamp.get(field) != first.get(field):
                raise PartsDisagree(
                    f"{name} ran with {field} {stamp.get(field)!r}, {names[0]} with"
                    f" {first.get(field)!r}"
                )


def _check_args(names: Sequence[str], parts: Sequence[dict[str, Any]]) -> None:
    first = parts[0]["args"]
    for name, part in zip(names, parts, strict=True):
        args = part["args"]
        for key in sorted((set(args) | set(first)) - PER_PART):
            if args.get(key) != first.get(key):
                raise PartsDisagree(
                    f"{name} ran with {key}={args.get(key)!r}, {names[0]} with"
                    f" {key}={first.get(key)!r}"
                )
        for key in sorted((set(part) | set(parts[0])) - RECORDS):
            if _shared(part, key) != _shared(parts[0], key):
                raise PartsDisagree(f"{name} records another {key} than {names[0]}")
    drawn_at: dict[int, tuple[str, dict[str, Any]]] = {}
    for name, part in zip(names, parts, strict=True):
        first_name, first = drawn_at.setdefault(part["args"]["seed"], (name, part))
        for key in sorted(SEED_DRAWN.keys() & part.keys()):
            if part[key] != first.get(key):
                raise PartsDisagree(f"{name} records another {key} than {first_name}, same seed")


def _shared(part: dict[str, Any], key: str) -> Any:
    """The part's record `key` less the fields it drew at its own seed (`SEED_DRAWN`)."""
    record = part.get(key)
    drawn = SEED_DRAWN.get(key, frozenset())
    if not drawn or not isinstance(record, dict):
        return record
    return {k: v for k, v in record.items() if k not in drawn}


def _union(lists: Sequence[Sequence[str]]) -> list[str]:
    """Every item, in the order it first appears."""
    seen: dict[str, None] = {}
    for items in lists:
        seen.update(dict.fromkeys(items))
    return list(seen)


def _join_seeds(names: Sequence[str], parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each seed's points from every part that ran it; a (seed, variant) from one part only."""
    seeds: dict[str, dict[str, list[Any]]] = {}
    came_from: dict[tuple[str, str], str] = {}
    for name, part in zip(names, parts, strict=True):
        for seed, runs in part["seeds"].items():
            joined = seeds.setdefault(seed, {})
            for label in {_label(p) for points in runs.values() for p in points}:
                if (seed, label) in came_from:
                    raise PartsDisagree(
                        f"seed {seed}, {label!r}: in both {came_from[(seed, label)]} and {name}"
                    )
                came_from[(seed, label)] = name
            for key, points in runs.items():
                joined.setdefault(key, []).extend(points)
    everyone = {label for _, label in came_from}
    for seed in seeds:
        lacking = sorted(everyone - {label for s, label in came_from if s == seed})
        if lacking:
            raise PartsDisagree(f"seed {seed} lacks {', '.join(map(repr, lacking))}: run its part")
    return dict(sorted(seeds.items(), key=lambda item: int(item[0])))


def merge(
    name: str, paths: Sequence[Path], parts: Sequence[dict[str, Any]], tag: str = ""
) -> dict[str, Any]:
    """The result of `name` that the `parts` (read from `paths`) make together; raises
    PartsDisagree when they are not one comparison."""
    if not parts:
        raise PartsDisagree("no parts to join")
    names = [p.name for p in paths]
    for part_name, part in zip(names, parts, strict=True):
        if f"bench/{name}.py" not in part.get("command", ""):
            raise PartsDisagree(f"{part_name} is not a result of bench/{name}.py")
    _check_stamps(names, parts)
    _check_args(names, parts)
    seeds = _join_seeds(names, parts)
    args = dict(parts[0]["args"])
    args.update(
        seed=min(int(s) for s in seeds),
        repeats=len(seeds),
        tag=tag,
        no_docs=False,
    )
    for key in ("variants", "length_variants"):
        if key in args:
            args[key] = _union([p["args"][key] for p in parts])
    dates = sorted(str(p["machine"]["date"]) for p in parts)
    machine = {**parts[0]["machine"], "date": dates[0] if len(set(dates)) == 1 else
               f"{dates[0]} to {dates[-1]}"}  # fmt: skip
    join = [".venv/bin/python", "bench/merge_results.py", name, *map(str, paths)]
    if tag:
        join += ["--tag", tag]
    lowest = min(parts, key=lambda p: int(p["args"]["seed"]))  # what one run would record
    others = {k: v for k, v in lowest.items() if k not in RECORDS}
    return {
        "command": " && ".join([*(p["command"] for p in parts), shlex.join(join)]),
        "args": args,
        "machine": machine,
        **others,
        "seeds": seeds,
        "parts": [
            {"file": path.name, "command": p["command"], "machine": p["machine"]}
            for path, p in zip(paths, parts, strict=True)
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("name", help="the benchmark (its script's name: relay_bench)")
    parser.add_argument("parts", nargs="+", type=Path, help="the parts' result files")
    parser.add_argument("--tag", default="", help="write bench/results/NAME_TAG.json")
    args = parser.parse_args(argv)
    parts = [json.loads(p.read_text()) for p in args.parts]
    try:
        joined = merge(args.name, [_relative(p) for p in args.parts], parts, args.tag)
    except PartsDisagree as err:
        print(f"cannot join: {err}", file=sys.stderr)
        return 2
    results = ROOT / "bench" / "results"
    out = results / f"{result_name(args.name, args)}.json"
    out.write_text(dumps_result(joined))
    kept = results / "parts"  # beside, not among, the results that render a docs section
    kept.mkdir(exist_ok=True)
    for path in args.parts:
        if path.resolve().parent == results.resolve():
            path.rename(kept / path.name)
    print(f"wrote {out.relative_to(ROOT)} ({len(joined['seeds'])} seeds from {len(parts)} parts)")
    print(f"render: .venv/bin/python bench/{args.name}.py --from-json {out.relative_to(ROOT)}")
    return 0


def _relative(path: Path) -> Path:
    """`path` from the repository's root when it lies inside it (the command reruns there)."""
    resolved = path.resolve()
    return resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved


if __name__ == "__main__":
    sys.exit(main())
