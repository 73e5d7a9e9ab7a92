"""CPU pinning for the serving benchmark: CPU lists parsed and checked against the host, and every thread of
the harness moved, including threads started before the pinning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grstack.runtime.bench.cpu_pinning import format_cpus, parse_cpus
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit

ALLOWED = sorted(os.sched_getaffinity(0))


def test_lists_and_ranges_parse_and_format_back():
    first = ALLOWED[0]
    assert parse_cpus("--x", str(first)) == {first}
    assert parse_cpus("--x", f" {first} , {first}") == {first}
    if len(ALLOWED) >= 2 and ALLOWED[1] == first + 1:
        assert parse_cpus("--x", f"{first}-{first + 1}") == {first, first + 1}
    assert format_cpus({0, 2, 3, 4, 7}) == "0,2-4,7"
    assert format_cpus({5}) == "5"


@pytest.mark.parametrize("text, needle", [("a", "expected CPU numbers"), ("3-1", "not a CPU range"),
                                          ("-1", "expected CPU numbers"), (",", "no CPUs"),
                                          ("4096", "not available here")])
def test_bad_lists_name_the_flag_and_the_problem(text, needle):
    with pytest.raises(UserError) as err:
        parse_cpus("--ranker-cpus", text)
    assert "--ranker-cpus" in str(err.value) and needle in str(err.value)


def test_pinning_moves_every_thread_of_the_process():
    target = ALLOWED[-1]
    code = (
        "import os, threading, time\n"
        "from grstack.runtime.bench.cpu_pinning import pin_this_process\n"
        "ev = threading.Event()\n"
        "t = threading.Thread(target=ev.wait, daemon=True); t.start()\n"  # started before the pinning
        f"n = pin_this_process(frozenset({{{target}}}))\n"
        "late = threading.Thread(target=ev.wait, daemon=True); late.start()\n"  # inherits the main thread's mask
        "masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir('/proc/self/task')}\n"
        "print(n, len(masks), sorted({str(m) for m in masks.values()}))\n"
        "ev.set()\n"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pinned, threads, masks = out.stdout.split(" ", 2)
    assert int(pinned) >= 2 and int(threads) >= 3
    assert masks.strip() == str([str([target])])
