"""Which CPUs a benchmark's parts run on: the load generator and router (this process) on some cores, the
rankers under test on others, as a test bed with a separate client machine would have them.

On a shared host the harness and the rankers otherwise compete for the same cores, and the harness's wait for
a core lands in every latency it measures (docs/bench-serve.md). Pinning them apart (Linux affinity masks)
takes that wait out, at the price of fewer cores for each.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grstack.runtime.errors import UserError


def parse_cpus(flag: str, text: str) -> frozenset[int]:
    """``"0"``, ``"2-11"``, ``"0,3-5"`` as a set of CPU numbers; each must be one this process may run on."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise UserError(f"{flag}: expected CPU numbers and ranges like 0,2-5, got {text!r}") from None
        if first < 0 or last < first:
            raise UserError(f"{flag}: {part!r} is not a CPU range (first <= last, both >= 0)")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise UserError(f"{flag}: no CPUs in {text!r}")
    if sys.platform != "linux":
        raise UserError(f"{flag}: pinning to CPUs needs Linux (sched_setaffinity)")
    allowed = os.sched_getaffinity(0)
    missing = sorted(cpus - allowed)
    if missing:
        raise UserError(f"{flag}: CPU(s) {', '.join(map(str, missing))} not available here (this process may run "
                        f"on {format_cpus(allowed)})")
    return frozenset(cpus)


def format_cpus(cpus: set[int] | frozenset[int]) -> str:
    """The inverse of :func:`parse_cpus`: ``{0, 2, 3, 4}`` -> ``"0,2-4"``."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def pin_this_process(cpus: frozenset[int]) -> int:
    """Restricts every thread of this process to ``cpus`` (``sched_setaffinity(0)`` alone moves only the
    calling thread; threads started later inherit their creator's mask). Returns the threads pinned."""
    tids = [int(t.name) for t in Path("/proc/self/task").iterdir()]
    pinned = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread exited meanwhile
            continue
        pinned += 1
    return pinned
