"""Choose the torch device a ranker computes on: Ascend NPU, CUDA or CPU."""

import importlib
from enum import StrEnum

import torch

from relaygr.errors import ConfigError, DeviceUnavailable


class DeviceKind(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"


def parse_device_kind(value: str) -> DeviceKind:
    try:
        return DeviceKind(value.lower())
    except ValueError as err:
        valid = ", ".join(kind.value for kind in DeviceKind)
        raise ConfigError(f"device {value!r} is not one of: {valid}") from err


def select_device(kind: DeviceKind | str, index: int = 0) -> torch.device:
    """Return the device for `kind`.

    `auto` means CUDA when present, else CPU. Ascend is used only when asked for (`npu`),
    because importing torch_npu where no Ascend runtime exists breaks `import torch`.
    """
    kind = parse_device_kind(kind) if isinstance(kind, str) else kind
    if kind is DeviceKind.CPU:
        return torch.device("cpu")
    if kind is DeviceKind.AUTO:
        return torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")
    if kind is DeviceKind.CUDA:
        if not torch.cuda.is_available():
            raise DeviceUnavailable("device 'cuda' requested but torch sees no CUDA device")
        return torch.device("cuda", index)
    try:
        importlib.import_module("torch_npu")
    except ImportError as err:
        raise DeviceUnavailable(
            "device 'npu' requested but torch_npu is not installed "
            "(pip install 'relaygr[ascend]' on an Ascend host)"
        ) from err
    if not torch.npu.is_available():  # type: ignore[attr-defined]
        raise DeviceUnavailable("device 'npu' requested but torch_npu sees no Ascend device")
    return torch.device("npu", index)
