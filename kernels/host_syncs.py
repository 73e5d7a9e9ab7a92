"""Counts the calls that would make the host wait for an accelerator, on any device (CPU included).

On CUDA, CUDA's sync debug mode is the exact counter (``grstack.runtime.device.HostSyncCounter``); it
reports nothing on CPU. This counter is what CPU runs and tests can measure: the aten operators that block
the host on CUDA, seen by a :class:`torch.utils._python_dispatch.TorchDispatchMode` —

- scalar reads ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``t.__index__``);
- data-dependent shapes: ``nonzero``, ``masked_select``, indexing or ``index_put_`` with a bool mask (which
  runs ``nonzero``), ``unique`` and friends, ``repeat_interleave`` without ``output_size``;
- blocking copies between devices (``_to_copy`` / ``copy_`` to or from another device, not ``non_blocking``);

plus the Python-level reads that dispatch nothing on CPU but copy to the host on a device: ``Tensor.cpu``,
``.tolist`` and ``.numpy``. Only calls on tensors of ``device`` count (``cpu``: every call, so host-only
bookkeeping on CPU tensors counts too and the figure is an upper bound of what a device run would wait for),
made by the thread that entered the counter.
Interpreted Triton launches (``TRITON_INTERPRET=1``) stand for device kernel launches, which do not wait:
what the interpreter does inside one is not counted.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

METHOD = ("aten ops that block the host on CUDA (_local_scalar_dense: item/int/float/bool; nonzero, "
          "masked_select, bool-mask index/index_put_, unique, repeat_interleave without output_size; blocking "
          "cross-device copies) via TorchDispatchMode, plus Tensor.cpu/.tolist/.numpy calls; on CPU every such "
          "call counts (host-only tensors too: an upper bound)")

_aten = torch.ops.aten
_SCALAR_AND_SHAPE = {
    _aten._local_scalar_dense.default: "item",
    _aten.nonzero.default: "nonzero",
    _aten.nonzero_static.default: None,  # a static size: no sync
    _aten.masked_select.default: "masked_select",
    _aten._unique.default: "unique",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten.repeat_interleave.Tensor: "repeat_interleave",
    _aten.repeat_interleave.self_Tensor: "repeat_interleave",
}
_PYTHON_READS = ("cpu", "tolist", "numpy")


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


class HostSyncCount(TorchDispatchMode):
    """Context manager; ``count`` (total) and ``by_kind`` (a Counter) hold what was seen while active;
    ``counter`` names the method (the figure's label wherever it is printed)."""

    counter = METHOD

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device_type = torch.device(device).type
        self.by_kind: Counter[str] = Counter()
        self._paused = 0
        self._saved: dict[str, Callable] = {}
        self._thread = threading.get_ident()

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device_type

    def _kind(self, func, args, kwargs) -> str | None:
        if func in _SCALAR_AND_SHAPE:
            kind = _SCALAR_AND_SHAPE[func]
            if kind == "repeat_interleave" and kwargs.get("output_size") is not None:
                return None
            return kind
        if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                    _aten._index_put_impl_.default):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype == torch.bool for i in indices):
                return "bool_index"
            return None
        if func is _aten._to_copy.default:
            dst = kwargs.get("device")
            if dst is not None and not kwargs.get("non_blocking", False):
                return self._copy_kind(args[0].device, torch.device(dst))
            return None
        if func is _aten.copy_.default and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
            return self._copy_kind(args[1].device, args[0].device)
        return None

    def _copy_kind(self, src: torch.device, dst: torch.device) -> str | None:
        """A blocking copy between this device and another one (either way)."""
        if src.type != dst.type and self.device_type in (src.type, dst.type):
            return "copy"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            kind = self._kind(func, args, kwargs)
            if kind is not None and (kind == "copy" or any(self._on_device(t) for t in _tensors(args, kwargs))):
                self.by_kind[kind] += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _python_read(self, name: str, orig: Callable) -> Callable:
        @functools.wraps(orig)
        def wrapper(t, *args, **kwargs):
            if self._paused or threading.get_ident() != self._thread or not self._on_device(t):
                return orig(t, *args, **kwargs)
            self.by_kind[name] += 1
            with self.paused():  # the copy it makes is this one call
                return orig(t, *args, **kwargs)
        return wrapper

    def _interpreted_launch(self, orig: Callable) -> Callable:
        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            with self.paused():
                return orig(*args, **kwargs)
        return wrapper

    def __enter__(self) -> HostSyncCount:
        self._thread = threading.get_ident()  # dispatch modes are per thread; the Python reads are made so
        self._saved = {name: getattr(torch.Tensor, name) for name in _PYTHON_READS}
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, self._python_read(name, orig))
        interpreter = _interpreter()
        if interpreter is not None:
            self._saved["__interpreter__"] = interpreter.run
            interpreter.run = self._interpreted_launch(interpreter.run)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            interpreter = _interpreter()
            if interpreter is not None and "__interpreter__" in self._saved:
                interpreter.run = self._saved.pop("__interpreter__")
            for name, orig in self._saved.items():
                setattr(torch.Tensor, name, orig)
            self._saved = {}


def _interpreter():
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return None
    return InterpretedFunction


def count_host_syncs(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Runs ``fn`` and returns the calls :class:`HostSyncCount` saw (see :data:`METHOD`)."""
    with HostSyncCount(device) as counter:
        fn()
    return counter.count
