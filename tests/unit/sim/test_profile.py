"""Device profiles: the shipped files load, write_profile and load_profile round-trip, and a bad
file is refused with the file and line at fault."""

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from relaygr.cost import CostModel
from relaygr.errors import InvalidInput
from tooling.sim.profile import MIB, DeviceProfile, load_profile, write_profile

PROFILES = sorted((Path(__file__).parents[3] / "profiles").glob("*.toml"))

# A valid profile; the cases below edit it by line number (1-based).
BASE = """\
name = "test"
kind = "assumed"
description = "a profile for tests"
sources = ["a source"]
assumptions = ["an assumption"]

[cost]
fixed_ms = 1.0
per_token_ms = 0.001
per_pair_ms = 1e-7
per_candidate_key_ms = 2e-7
reload_ms_per_mb = 0.02

[memory]
device_tier_mib = 1024
host_tier_mib = 4096
kv_bytes_per_token = 1032

[latency]
request_overhead_ms = 1.5
compute_noise = 0.05
"""


# How load_profile words its refusals.
SECTIONS = "expected one of ['cost', 'latency', 'memory']"
TOP_KEYS = "expected one of name, description, kind, sources, assumptions"
COST_KEYS = (
    "expected one of fixed_ms, per_token_ms, per_pair_ms, per_candidate_key_ms, "
    "reload_ms_per_mb, median_abs_rel_error, samples, utilisation, "
    "batch_saving_ms, batch_samples, cached_fixed_ms, cached_per_row_ms, cached_per_key_ms, "
    "cached_per_row_key_ms"
)
NUMBER = "must be a finite number >= 0, got"


def _edit(changes: dict[int, str | None]) -> str:
    """BASE with line N replaced (None: removed); N one past the end appends."""
    lines: list[str | None] = list(BASE.splitlines())
    for number, text in changes.items():
        if number == len(lines) + 1:
            lines.append(text)
        else:
            lines[number - 1] = text
    return "\n".join(line for line in lines if line is not None) + "\n"


def _refusal(tmp_path: Path, text: str) -> tuple[Path, str]:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InvalidInput) as caught:
        load_profile(path)
    return path, str(caught.value)


def _profile(**changes: Any) -> DeviceProfile:
    profile = DeviceProfile(
        name="edge",
        cost=CostModel(
            1.25,
            1e-3,
            3.974e-7,
            0.1 + 0.2,
            0.02097,
            median_abs_rel_error=0.14,
            samples=9,
            batch_saving_ms=0.1 + 0.7,
            batch_samples=4,
            cached_fixed_ms=2.5,
            cached_per_row_ms=0.1 + 0.4,
            cached_per_key_ms=1e-300,
            cached_per_row_key_ms=2.0174899762357557e-05,
        ),
        device_tier_bytes=40 * 1024 * MIB + 12345,
        host_tier_bytes=3,
        kv_bytes_per_token=98312,
        request_overhead_ms=1.5,
        compute_noise=0.05,
        kind="measured",
        description='line one\nline two\ttabbed, "quoted", back\\slash, \x7f, µs and 中文',
        sources=('a "source"', "C:\\path"),
        assumptions=(),
    )
    return replace(profile, **changes)


def test_the_base_text_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "base.toml"
    path.write_text(BASE)
    profile = load_profile(path)
    assert profile.cost == CostModel(1.0, 0.001, 1e-7, 2e-7, 0.02)
    assert (profile.device_tier_bytes, profile.host_tier_bytes) == (1024 * MIB, 4096 * MIB)
    assert (profile.request_overhead_ms, profile.compute_noise) == (1.5, 0.05)


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_every_shipped_profile_loads(path: Path) -> None:
    profile = load_profile(path)
    assert profile.name == path.stem
    assert profile.kind == "assumed"
    assert profile.sources and profile.assumptions  # every figure cited or labelled a guess
    assert profile.device_tier_bytes > 0 and profile.host_tier_bytes > 0
    assert profile.cost.full_ms(4096, 256) > profile.cost.rank_ms(4096, 128, 256)


def test_the_accelerator_profiles_are_shipped() -> None:
    assert [p.stem for p in PROFILES] == ["ascend-910b", "nvidia-h100", "nvidia-h200"]


def test_write_then_load_gives_an_equal_profile(tmp_path: Path) -> None:
    profile = _profile()
    path = tmp_path / "out.toml"
    write_profile(profile, path)
    assert load_profile(path) == profile


def test_write_then_load_keeps_defaults(tmp_path: Path) -> None:
    profile = _profile(
        cost=CostModel(0.0, 0.0, 0.0, 0.0, 0.0),
        request_overhead_ms=0.0,
        compute_noise=0.0,
        kind="assumed",
        description="",
        sources=(),
        assumptions=(),
    )
    path = tmp_path / "out.toml"
    write_profile(profile, path)
    assert load_profile(path) == profile


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_a_shipped_profile_round_trips(path: Path, tmp_path: Path) -> None:
    profile = load_profile(path)
    copy = tmp_path / path.name
    write_profile(profile, copy)
    assert load_profile(copy) == profile


@pytest.mark.parametrize(
    ("changes", "line", "message"),
    [
        # a key without '='
        ({10: "per_pair_ms 1e-7"}, 10, "Expected '=' after a key in a key/value pair"),
        # the text ends inside an array: the last line
        ({22: 'tags = ["a"'}, 22, "Unclosed array"),
        ({3: 'description = "open'}, 3, "Illegal character '\\n'"),
    ],
    ids=["no-equals", "unclosed-at-end", "unclosed-string"],
)
def test_a_toml_syntax_error_names_its_line(
    tmp_path: Path, changes: dict[int, str | None], line: int, message: str
) -> None:
    path, error = _refusal(tmp_path, _edit(changes))
    assert error == f"{path}:{line}: {message}"


@pytest.mark.parametrize(
    ("changes", "line", "message"),
    [
        # missing keys: the line of their section's header, line 1 at top level or without one
        pytest.param({10: None}, 7, "[cost] per_pair_ms: missing", id="missing"),
        pytest.param({17: None}, 14, "[memory] kv_bytes_per_token: missing", id="missing-last"),
        pytest.param({1: None}, 1, "name: missing", id="missing-top"),
        pytest.param(
            {14: None, 15: None, 16: None, 17: None},
            1,
            "[memory] device_tier_mib: missing",
            id="missing-section",
        ),
        # unknown keys and sections: the line that names them
        pytest.param(
            {22: "bogus = 1"},
            22,
            "[latency] bogus: unknown key; expected one of request_overhead_ms, compute_noise",
            id="unknown-key",
        ),
        pytest.param(
            {13: '"per_pair_msx" = 1'},
            13,
            f"[cost] per_pair_msx: unknown key; {COST_KEYS}",
            id="unknown-quoted-key",
        ),
        pytest.param({6: "bogus = 1"}, 6, f"bogus: unknown key; {TOP_KEYS}", id="unknown-top"),
        pytest.param({18: "[extra]"}, 18, f"extra: unknown section; {SECTIONS}", id="section"),
        pytest.param(
            {6: "extra = { a = 1 }"}, 6, f"extra: unknown section; {SECTIONS}", id="inline-table"
        ),
        # a misspelt header that is the start of a real one earlier in the file
        pytest.param({18: "[cos]"}, 18, f"cos: unknown section; {SECTIONS}", id="prefix"),
        pytest.param({18: "[[extra]]"}, 18, f"extra: unknown key; {TOP_KEYS}", id="array-table"),
        pytest.param(
            {18: "[cost.extra]"}, 18, f"[cost] extra: unknown key; {COST_KEYS}", id="sub-table"
        ),
    ],
)
def test_a_misshapen_profile_is_refused_at_its_line(
    tmp_path: Path, changes: dict[int, str | None], line: int, message: str
) -> None:
    path, error = _refusal(tmp_path, _edit(changes))
    assert error == f"{path}:{line}: {message}"


@pytest.mark.parametrize(
    ("line", "text", "message"),
    [
        (16, "host_tier_mib = -4096", f"[memory] host_tier_mib: {NUMBER} -4096"),
        (11, "per_candidate_key_ms = -0.5", f"[cost] per_candidate_key_ms: {NUMBER} -0.5"),
        (9, 'per_token_ms = "0.001"', f"[cost] per_token_ms: {NUMBER} '0.001'"),
        (8, "fixed_ms = true", f"[cost] fixed_ms: {NUMBER} True"),
        (15, "device_tier_mib = nan", f"[memory] device_tier_mib: {NUMBER} nan"),
        (
            17,
            "kv_bytes_per_token = 1.5",
            "[memory] kv_bytes_per_token: must be an integer, got 1.5",
        ),
        (17, "kv_bytes_per_token = 0", "[memory] kv_bytes_per_token: must be positive"),
        (2, 'kind = "guessed"', "kind: must be one of measured, assumed, got 'guessed'"),
        (21, "compute_noise = 1.0", "[latency] compute_noise: must be in [0, 1), got 1.0"),
        (21, "compute_noise = 2", "[latency] compute_noise: must be in [0, 1), got 2"),
        (1, 'name = ""', "name: must be a non-empty string, got ''"),
        (4, 'sources = "one"', "sources: must be a list of strings"),
    ],
)
def test_a_bad_value_is_refused_at_its_line(
    tmp_path: Path, line: int, text: str, message: str
) -> None:
    path, error = _refusal(tmp_path, _edit({line: text}))
    assert error == f"{path}:{line}: {message}"


def test_an_unreadable_profile_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(InvalidInput, match=rf"^{re.escape(str(path))}: cannot read the profile"):
        load_profile(path)
