"""Device selection: CPU always, CUDA when present, Ascend only when asked for and installed."""

import importlib.util

import pytest
import torch

from relaygr.device import DeviceKind, parse_device_kind, select_device
from relaygr.errors import ConfigError, DeviceUnavailable


def test_cpu_and_auto() -> None:
    assert select_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device(DeviceKind.AUTO).type == expected


def test_unknown_device_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="device 'tpu' is not one of: auto, cpu, cuda, npu"):
        parse_device_kind("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_device_is_refused() -> None:
    with pytest.raises(DeviceUnavailable, match="no CUDA device"):
        select_device("cuda")


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed"
)
def test_npu_without_torch_npu_is_refused_with_a_hint() -> None:
    with pytest.raises(DeviceUnavailable, match=r"torch_npu is not installed.*relaygr\[ascend\]"):
        select_device("npu")


def test_auto_never_picks_the_npu() -> None:
    assert select_device("auto").type in {"cpu", "cuda"}
