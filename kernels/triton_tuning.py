"""Tile configurations of the fused attention kernels, and the autotuner that picks one per shape.

Every candidate here compiles for sm_90 without register spills at the head sizes and feature sets it is
listed for (``grstack bench kernels --compile-report`` prints the figures; a test asserts zero spills for
each). On CUDA the first call with a new :class:`TuneKey` times each candidate once (one warm-up launch,
then the median of three timed ones, on CUDA events) and caches the fastest for the process; the key holds
only host-side facts (dtype, head sizes, heads, features, the model's maximum length), so choosing never
reads device memory. ``GRSTACK_TRITON_AUTOTUNE=0`` takes the first candidate instead. Under
``TRITON_INTERPRET=1`` small tiles keep the numpy interpreter fast.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

ENV_AUTOTUNE = "GRSTACK_TRITON_AUTOTUNE"


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class TuneKey:
    kernel: str  # fwd | bwd_kv | bwd_q
    dtype: str
    block_dqk: int
    block_dv: int
    heads: int
    features: tuple[str, ...]
    max_len_bucket: int


INTERPRETER = TileConfig(16, 16, 1, 1)

# Spill-free on sm_90 (Triton 3.9, ptxas), by kernel and padded head size; the first is the default.
_T = TileConfig
_CANDIDATES: dict[tuple[str, int], tuple[TileConfig, ...]] = {
    ("fwd", 16): (_T(64, 64, 8, 3), _T(64, 32, 4, 3), _T(128, 64, 8, 3), _T(64, 32, 8, 3)),
    ("fwd", 32): (_T(64, 64, 8, 3), _T(64, 32, 4, 3), _T(128, 64, 8, 3)),
    ("fwd", 64): (_T(64, 64, 8, 3), _T(64, 32, 8, 3), _T(32, 32, 4, 3), _T(64, 16, 8, 2)),
    ("fwd", 128): (_T(64, 16, 8, 2),),
    # key-major backward: block_n keys per program, block_m queries per inner step (block_m >= block_n
    # with position-table gradients)
    ("bwd_kv", 16): (_T(32, 16, 8, 1), _T(32, 32, 8, 1), _T(16, 16, 4, 1), _T(32, 64, 8, 2), _T(16, 64, 4, 2)),
    ("bwd_kv", 32): (_T(32, 16, 8, 1), _T(32, 16, 4, 1), _T(16, 16, 4, 1), _T(32, 64, 8, 2), _T(16, 64, 4, 2)),
    ("bwd_kv", 64): (_T(32, 32, 8, 1), _T(32, 16, 8, 1), _T(32, 16, 4, 1), _T(32, 64, 8, 2), _T(16, 32, 8, 1)),
    ("bwd_kv", 128): (_T(32, 16, 8, 1), _T(16, 16, 4, 1), _T(16, 32, 8, 1)),
    ("bwd_q", 16): (_T(64, 32, 4, 3), _T(64, 32, 8, 3), _T(64, 16, 8, 2)),
    ("bwd_q", 32): (_T(64, 32, 4, 3), _T(64, 32, 8, 3), _T(64, 16, 8, 2)),
    ("bwd_q", 64): (_T(64, 32, 8, 3), _T(64, 16, 8, 2)),
    ("bwd_q", 128): (_T(32, 16, 8, 1), _T(16, 32, 4, 1), _T(16, 16, 4, 1)),
}

_chosen: dict[TuneKey, TileConfig] = {}


def max_len_bucket(max_seq_len: int) -> int:
    """Next power of two of the model's maximum length: shapes in one bucket share a configuration."""
    return triton.next_power_of_2(max(1, int(max_seq_len)))


def candidates(kernel: str, block_d: int, features: tuple[str, ...] = ()) -> tuple[TileConfig, ...]:
    """The configurations tried for ``kernel`` at padded head size ``block_d`` (the larger of dqk, dv).

    One list per head size is spill-free for every feature set (see the compile report); the position
    table's gradient needs at least as many queries as keys per tile (``block_m >= block_n``).
    """
    options = _CANDIDATES[(kernel, min(max(triton.next_power_of_2(block_d), 16), 128))]
    if kernel == "bwd_kv" and "POS_GRAD" in features:
        options = tuple(c for c in options if c.block_m >= c.block_n)
    return options


def run_tuned(key: TuneKey, interpreted: bool, launch: Callable[[TileConfig], None]) -> TileConfig:
    """Runs ``launch`` with the configuration chosen for ``key`` (tuning it first if needed); returns it.

    ``launch`` must be idempotent (it may run once per candidate while tuning; the last run is the chosen
    one's, so its outputs stand).
    """
    if interpreted:
        launch(INTERPRETER)
        return INTERPRETER
    cfg = _chosen.get(key)
    if cfg is None:
        options = candidates(key.kernel, max(key.block_dqk, key.block_dv), key.features)
        cfg = options[0] if len(options) == 1 or os.environ.get(ENV_AUTOTUNE) == "0" else _tune(options, launch)
        _chosen[key] = cfg
    launch(cfg)
    return cfg


def chosen() -> dict[TuneKey, TileConfig]:
    """The configurations picked so far in this process (for reports)."""
    return dict(_chosen)


def _tune(options: tuple[TileConfig, ...], launch: Callable[[TileConfig], None]) -> TileConfig:
    times = []
    for cfg in options:
        launch(cfg)  # compiles
        samples = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch(cfg)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        times.append(statistics.median(samples))
    return options[min(range(len(options)), key=times.__getitem__)]
