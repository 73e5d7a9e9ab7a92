"""One device helper for cpu / cuda / npu (Ascend via torch_npu when it imports)."""

from __future__ import annotations

import functools

import torch

from grstack.runtime.errors import UserError


@functools.cache
def npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks cuda, then npu, then cpu; an explicit device that is not present is a user error."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    kind = name.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but CUDA is not available")
    if kind == "npu" and not npu_available():
        raise UserError(f"device {name!r} requested but torch_npu / an Ascend NPU is not available")
    if kind not in ("cpu", "cuda", "npu"):
        raise UserError(f"unknown device {name!r}; expected auto, cpu, cuda[:N] or npu[:N]")
    return torch.device(name)


def distributed_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)
