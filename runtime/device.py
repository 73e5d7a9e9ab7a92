"""One device helper for cpu / cuda / npu (Ascend via torch_npu when it imports)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

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


def set_current_device(device: torch.device) -> None:
    """Makes ``device`` the thread's current accelerator (NCCL/HCCL and ``torch.cuda`` calls without an
    explicit index use it); no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)


def local_device(device: torch.device, local_rank: int) -> torch.device:
    """The accelerator of local rank ``local_rank`` when ``device`` names a kind without an index (several
    ranks per pod or machine, one accelerator each); a user error when there are fewer accelerators than
    local ranks. CPU is returned as is, and so is an explicit index for local rank 0; for another local rank
    it is a user error (every rank would share that accelerator, which NCCL/HCCL refuse mid-start)."""
    if device.type not in ("cuda", "npu"):
        return device
    if device.index is not None:
        if local_rank > 0:
            raise UserError(f"train.device={device} on LOCAL_RANK={local_rank}: each local rank takes its own "
                            f"accelerator ({device.type}:<local rank>); use train.device={device.type}")
        return device
    count = torch.cuda.device_count() if device.type == "cuda" else torch.npu.device_count()
    if local_rank >= count:
        raise UserError(f"LOCAL_RANK={local_rank} needs a {device.type} device of its own, but this machine "
                        f"(or pod) has {count}; start at most {count} ranks per machine")
    return torch.device(device.type, local_rank)


def check_precision(device: torch.device, precision: str) -> None:
    """A precision ``device`` cannot train in is a user error (before anything starts)."""
    if precision == "fp32":
        return
    if precision != "bf16":
        raise UserError(f"train.precision={precision!r}: expected fp32 or bf16")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise UserError(f"train.precision=bf16: {name} has no bfloat16 support (it needs compute capability "
                        ">= 8.0, e.g. A100/H100); use train.precision=fp32 (with train.tf32=true on Ampere+)")
    if device.type == "cpu" and not hasattr(torch, "autocast"):
        raise UserError("train.precision=bf16 needs torch.autocast on CPU (torch >= 1.10)")


def configure_precision(device: torch.device, precision: str, tf32: bool) -> None:
    """Checks ``precision`` on ``device`` (a user error if it cannot run) and sets the TF32 switch (CUDA)."""
    check_precision(device, precision)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


class HostSyncCounter:
    """Counts the host-device synchronisations CUDA's sync debug mode reports while active (every thread
    of the process); ``count`` stays None on devices without such a mode (on CPU there is nothing to wait
    for: ``host_sync_counter`` gives ``grstack.kernels.HostSyncCount`` there)."""

    counter = "cuda-sync-debug-mode"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.count: int | None = None
        self._catch: Any = None
        self._records: list[Any] = []

    def __enter__(self) -> HostSyncCounter:
        if self.device.type == "cuda":
            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._catch is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        self.count = sum(1 for w in self._records if "synchroniz" in str(w.message).lower())
        for w in self._records:  # everything else is shown as usual
            if "synchroniz" not in str(w.message).lower():
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def host_sync_counter(device: torch.device) -> Any:
    """The host-sync counter of ``device``: CUDA's sync debug mode on CUDA (exact); elsewhere
    ``grstack.kernels.HostSyncCount``, the aten operators that would block the host on an accelerator, seen in
    the entering thread (on CPU an upper bound: host bookkeeping counts too). Both name their method in
    ``counter``."""
    if device.type == "cuda":
        return HostSyncCounter(device)
    from grstack.kernels import HostSyncCount

    return HostSyncCount(device)
