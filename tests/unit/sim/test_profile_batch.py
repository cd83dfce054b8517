"""The accelerator profiles' batch efficiencies, as profiles/README.md tabulates them."""

import re
from pathlib import Path

import pytest

from relaygr.cost import CallShape, batch_speedup
from tooling.sim.profile import load_profile

ROOT = Path(__file__).resolve().parents[3]
PROFILES = ROOT / "profiles"
ROW = re.compile(r"^\| ([\d,]+) \| ([\d.]+) \| (.+) \|$")


def _table() -> dict[int, list[float]]:
    text = (PROFILES / "README.md").read_text()
    section = text[text.index("## Batching") : text.index("## Writing your own")]
    rows = {}
    for line in section.splitlines():
        if (found := ROW.match(line)) is not None:
            cells = [float(c) for c in [found.group(2), *found.group(3).split(" | ")]]
            rows[int(found.group(1).replace(",", ""))] = cells
    return rows


@pytest.mark.parametrize("prefix", [256, 1024, 4096])
def test_the_readme_table_is_what_the_profiles_predict(prefix: int) -> None:
    gpu = load_profile(PROFILES / "nvidia-h100.toml").cost
    npu = load_profile(PROFILES / "ascend-910b.toml").cost
    assert load_profile(PROFILES / "nvidia-h200.toml").cost == gpu
    shape = CallShape(prefix, 64, 256)
    expected = []
    for cost in (gpu, npu):
        expected.append(cost.shape_ms(shape))
        expected += [batch_speedup(cost, shape, size) for size in (2, 4, 8, 16)]
    assert _table()[prefix] == pytest.approx(expected, abs=0.006)


def test_every_accelerator_profile_batches_at_its_per_call_cost() -> None:
    for path in PROFILES.glob("*.toml"):
        cost = load_profile(path).cost
        assert cost.batch_saving_ms == cost.fixed_ms > 0
        assert batch_speedup(cost, CallShape(1024, 64, 256), 1) == 1.0
