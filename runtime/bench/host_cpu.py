"""Where a benchmark point's CPU went, in cores (CPU-seconds per wall second): the harness (this process, the
load generator and the router), the rankers under test, and everything else on the host.

A serving limit measured on a shared host is the rankers' limit only if the host had cores to spare while it
was measured. The rankers' own accounting (compute-thread time per kind) cannot say that: it does not see
the harness, nor another job on the same cores. These figures come from the kernel's per-process and per-host
counters (psutil), sampled at a point's start and end.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU-seconds at one instant."""

    wall_s: float
    busy_s: float  # all cores, running anything (user, nice, system, irq, softirq)
    steal_s: float  # all cores, wanted by this VM and given to another by the hypervisor
    harness_s: float  # this process
    procs_s: dict[int, float] = field(default_factory=dict)  # watched processes by pid (those alive)


def _proc_seconds(p: Any) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def take(pids: Iterable[int] = ()) -> CpuSample:
    """A sample now; a watched process that has exited is left out (and so out of :func:`usage`)."""
    import psutil  # the serve extra's: imported here so that the pure functions below need nothing

    host = psutil.cpu_times()
    busy = sum(float(getattr(host, k, 0.0)) for k in ("user", "nice", "system", "irq", "softirq"))
    procs: dict[int, float] = {}
    for pid in pids:
        try:
            procs[pid] = _proc_seconds(psutil.Process(pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return CpuSample(wall_s=time.monotonic(), busy_s=busy, steal_s=float(getattr(host, "steal", 0.0)),
                     harness_s=_proc_seconds(psutil.Process()), procs_s=procs)


def usage(before: CpuSample, after: CpuSample, groups: dict[str, Iterable[int]],
          cores: int | None = None) -> dict[str, float | int | None]:
    """Cores used between two samples: ``busy`` (the host, all of it), ``harness``, one entry per group of
    watched pids (a pid counts only if both samples saw it), ``other`` (busy minus everything named: other
    processes on the host), and ``steal``. ``cores``: the host's, reported beside them (default: the logical
    CPU count)."""
    wall = after.wall_s - before.wall_s
    if cores is None:
        import psutil

        cores = psutil.cpu_count() or 1
    n = cores
    if wall <= 0:
        return {"cores": n, "wall_s": 0.0, "busy": None, "harness": None, "other": None, "steal": None,
                **{g: None for g in groups}}
    out: dict[str, float | int | None] = {"cores": n, "wall_s": round(wall, 3)}
    busy = (after.busy_s - before.busy_s) / wall
    harness = (after.harness_s - before.harness_s) / wall
    named = harness
    per_group: dict[str, float] = {}
    for name, pids in groups.items():
        s = sum(after.procs_s[p] - before.procs_s[p] for p in pids if p in before.procs_s and p in after.procs_s)
        per_group[name] = s / wall
        named += per_group[name]
    out.update({"busy": busy, "harness": harness, **per_group, "other": max(0.0, busy - named),
                "steal": (after.steal_s - before.steal_s) / wall})
    return out


def mean_usage(runs: list[dict[str, float | int | None]]) -> dict[str, float | int | None] | None:
    """The mean of each figure over several :func:`usage` results (repeats of one point)."""
    if not runs:
        return None
    out: dict[str, float | int | None] = {}
    for key in runs[0]:
        vals = [r.get(key) for r in runs]
        if key == "cores":
            out[key] = runs[0][key]
        elif any(v is None for v in vals):
            out[key] = None
        else:
            out[key] = sum(float(v) for v in vals if v is not None) / len(vals)
    return out
