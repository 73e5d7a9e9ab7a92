"""Host CPU accounting of the serving benchmark: the arithmetic over two samples, and that a real busy child
process shows up under its own group and not under the harness."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grstack.runtime.bench.host_cpu import CpuSample, mean_usage, take, usage

pytestmark = pytest.mark.unit


def test_usage_splits_the_host_into_harness_groups_and_other():
    before = CpuSample(wall_s=10.0, busy_s=100.0, steal_s=1.0, harness_s=5.0, procs_s={1: 2.0, 2: 3.0, 3: 0.0})
    after = CpuSample(wall_s=12.0, busy_s=103.6, steal_s=1.2, harness_s=5.8, procs_s={1: 3.0, 2: 4.0, 4: 9.0})
    u = usage(before, after, {"rankers": (1, 2), "idle_rankers": (3, 4)}, cores=2)
    assert u["cores"] == 2 and u["wall_s"] == pytest.approx(2.0)
    assert u["busy"] == pytest.approx(1.8)
    assert u["harness"] == pytest.approx(0.4)
    assert u["rankers"] == pytest.approx(1.0)
    assert u["idle_rankers"] == 0.0  # pid 3 exited and pid 4 appeared: neither was seen by both samples
    assert u["other"] == pytest.approx(0.4)
    assert u["steal"] == pytest.approx(0.1)


def test_usage_never_reports_negative_other_and_handles_no_elapsed_time():
    a = CpuSample(wall_s=1.0, busy_s=1.0, steal_s=0.0, harness_s=1.0, procs_s={7: 0.0})
    b = CpuSample(wall_s=2.0, busy_s=1.5, steal_s=0.0, harness_s=1.4, procs_s={7: 0.3})  # counter skew
    assert usage(a, b, {"rankers": (7,)}, cores=2)["other"] == 0.0
    none = usage(a, a, {"rankers": (7,)}, cores=2)
    assert none["busy"] is None and none["rankers"] is None


def test_mean_usage_over_repeats():
    runs = [{"cores": 2, "busy": 1.0, "rankers": 0.5}, {"cores": 2, "busy": 2.0, "rankers": None}]
    assert mean_usage(runs) == {"cores": 2, "busy": 1.5, "rankers": None}
    assert mean_usage([]) is None


def test_a_busy_child_counts_under_its_group_not_the_harness():
    spin = ("import time,sys\nsys.stdin.readline()\nt=time.process_time()\nwhile time.process_time()-t<0.4: pass\n"
            "print('done', flush=True)\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = take([child.pid])  # the child waits for a line before it spins: all its spinning comes after
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        after = take([child.pid, 999_999_999])  # a pid that does not exist is left out, not an error
        u = usage(before, after, {"child": (child.pid,)})
    finally:
        child.kill()
        child.wait()
    spent_child = u["child"] * u["wall_s"]
    assert spent_child >= 0.35  # the child spun 0.4 CPU-seconds after the first sample (10 ms counter ticks)
    assert u["harness"] * u["wall_s"] < 0.2  # this process only waited on a pipe
    assert u["busy"] * u["wall_s"] >= spent_child * 0.9
