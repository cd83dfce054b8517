"""Device profiles: the device tier sized from the device's memory, and utilisation rescaling."""

from pathlib import Path

import pytest

from relaygr.errors import InvalidInput
from tests.unit.sim.test_profile import BASE
from tooling.sim.profile import MIB, DeviceMemory, DeviceProfile, load_profile, write_profile

SIZED = BASE.replace(
    "device_tier_mib = 1024\n",
    "device_memory_mib = 4096\nruntime_mib = 512\nweights_mib = 256\n"
    "activations_mib = 1024\nother_mib = 1280\n",
).replace("reload_ms_per_mb = 0.02\n", "reload_ms_per_mb = 0.02\nutilisation = 0.25\n")
PROFILES = Path(__file__).resolve().parents[3] / "profiles"


def _load(tmp_path: Path, text: str) -> DeviceProfile:
    path = tmp_path / "p.toml"
    path.write_text(text)
    return load_profile(path)


def test_the_device_tier_is_what_memory_leaves_after_runtime_weights_activations_other(
    tmp_path: Path,
) -> None:
    profile = _load(tmp_path, SIZED)
    assert profile.memory == DeviceMemory(4096 * MIB, 512 * MIB, 256 * MIB, 1024 * MIB, 1280 * MIB)
    assert profile.device_tier_bytes == 1024 * MIB  # 4096 - 512 - 256 - 1024 - 1280
    assert profile.utilisation == 0.25
    copy = tmp_path / "copy.toml"
    write_profile(profile, copy)
    assert load_profile(copy) == profile
    # A tier set by hand is given, no longer sized.
    assert profile.with_memory(7 * MIB).memory is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            SIZED.replace("other_mib = 1280\n", "other_mib = 1280\ndevice_tier_mib = 1\n"),
            "[memory] device_tier_mib: give it or device_memory_mib, not both",
        ),
        (
            BASE.replace("device_tier_mib = 1024\n", "device_tier_mib = 1024\nweights_mib = 1\n"),
            "[memory] weights_mib: needs device_memory_mib",
        ),
        (
            SIZED.replace("other_mib = 1280\n", "other_mib = 2304\n"),
            "[memory] device_memory_mib: leaves no room for a device tier",
        ),
        (
            SIZED.replace("utilisation = 0.25", "utilisation = 1.5"),
            "[cost] utilisation: must be in [0, 1], got 1.5",
        ),
    ],
    ids=["both", "share-without-memory", "no-room", "utilisation-over-one"],
)
def test_a_misshapen_sizing_is_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=r"p\.toml:\d+: " + message.replace("[", r"\[")):
        _load(tmp_path, text)


def test_utilisation_scales_compute_terms_not_overheads(tmp_path: Path) -> None:
    cached = "cached_fixed_ms = 0.5\ncached_per_row_ms = 0.02\ncached_per_key_ms = 0.001\n"
    cached += "cached_per_row_key_ms = 2e-6\n"
    profile = _load(tmp_path, SIZED.replace("[memory]", cached + "[memory]"))  # at 0.25
    faster = profile.at_utilisation(0.5)  # twice the throughput: compute terms halve
    c, f = profile.cost, faster.cost
    assert c.prices_cached_ranks
    assert (
        f.per_token_ms, f.per_pair_ms, f.per_candidate_key_ms, f.cached_per_row_ms,
        f.cached_per_key_ms, f.cached_per_row_key_ms,
    ) == (
        c.per_token_ms / 2, c.per_pair_ms / 2, c.per_candidate_key_ms / 2,
        c.cached_per_row_ms / 2, c.cached_per_key_ms / 2, c.cached_per_row_key_ms / 2,
    )  # fmt: skip
    assert (f.fixed_ms, f.cached_fixed_ms, f.reload_ms_per_mb) == (
        c.fixed_ms, c.cached_fixed_ms, c.reload_ms_per_mb,
    )  # fmt: skip
    assert faster.utilisation == 0.5 and faster.at_utilisation(0.25) == profile
    with pytest.raises(InvalidInput, match="states no utilisation"):
        _load(tmp_path, BASE).at_utilisation(0.5)  # a profile that states none
    with pytest.raises(InvalidInput, match=r"utilisation must be in \(0, 1\]"):
        profile.at_utilisation(0.0)


@pytest.mark.parametrize("name", ["nvidia-h100", "ascend-910b"])
def test_the_accelerator_profiles_size_their_tier_and_state_their_utilisation(name: str) -> None:
    profile = load_profile(PROFILES / f"{name}.toml")
    assert profile.memory is not None and profile.memory.tier == profile.device_tier_bytes
    assert profile.utilisation == 0.25
