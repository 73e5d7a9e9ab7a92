"""Issue #12 item 9: rankers start reliably from a process whose etcd client (aetcd, gRPC) is busy.

Before the fix ``spawn_ranker`` passed a ``preexec_fn``, which makes CPython fork() instead of vfork(); fork()
runs gRPC's pthread_atfork handlers while gRPC's threads are mid-call, and the child died before exec
(SIGABRT after "epoll_wait error: Bad file descriptor", or SIGSEGV): 44 of 300 children on this machine with the
load below. The test keeps a lease keep-alive, a watch and a stream of reads in flight while it starts rankers
and plain children through the same launcher, and requires every one to come up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grstack.runtime.serve.local import die_with_parent, spawn_ranker
from grstack.runtime.serve.placement import Replica

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@contextlib.asynccontextmanager
async def busy_etcd_client(url: str):
    """An etcd client whose gRPC threads stay busy: a replica lease kept alive, a watch, and four readers."""
    from grstack.runtime.serve.etcd_store import EtcdPlacementStore

    store = EtcdPlacementStore(url, root="/grstack/ranking/forktest", timeout_s=5.0)
    await store.register(Replica("r0", "http://127.0.0.1:1"), ttl_s=2)
    calls = 0
    stop = asyncio.Event()

    async def watch() -> None:
        with contextlib.suppress(Exception):
            async for _ in store.watch():
                pass

    async def read(i: int) -> None:
        nonlocal calls
        while not stop.is_set():
            await store.replicas()
            await store.get_placement(f"u{i}-{calls % 7}")
            calls += 1

    tasks = [asyncio.create_task(watch()), *(asyncio.create_task(read(i)) for i in range(4))]
    try:
        await asyncio.sleep(0.5)
        yield lambda: calls
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()


async def test_rankers_start_while_an_etcd_client_is_busy(etcd, tiny_checkpoint: Path) -> None:
    async with busy_etcd_client(etcd.url) as calls:
        before = calls()
        # Plain children through the same launcher: cheap, so many forks/vforks land inside gRPC calls.
        for i in range(100):
            proc = await asyncio.create_subprocess_exec(*die_with_parent([sys.executable, "-S", "-c", "pass"]),
                                                        stderr=asyncio.subprocess.PIPE)
            _, err = await proc.communicate()
            assert proc.returncode == 0, f"child {i} exited with {proc.returncode}: {err.decode()[-500:]}"
        # Rankers, three at a time, four rounds: each must report ready.
        for _ in range(4):
            rankers = await asyncio.gather(*(spawn_ranker(tiny_checkpoint, ["--device", "cpu", "--threads", "1",
                                                                            "--max-suffix", "8"])
                                             for _ in range(3)))
            try:
                assert all(r.url.startswith("http://") and r.proc.returncode is None for r in rankers)
            finally:
                await asyncio.gather(*(r.stop() for r in rankers))
        assert calls() > before + 20, "the etcd client was not busy while children were started"


def test_a_launched_child_dies_with_its_parent(tmp_path: Path) -> None:
    """The launcher replaces the old preexec_fn's PR_SET_PDEATHSIG: no orphaned rankers."""
    if sys.platform != "linux":
        pytest.skip("PR_SET_PDEATHSIG is Linux-only")
    pidfile = tmp_path / "pid"
    parent = (
        "import subprocess, sys\n"
        "from grstack.runtime.serve.local import die_with_parent\n"
        "p = subprocess.Popen(die_with_parent(['sleep', '60']))\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "import time; time.sleep(1.0)\n"  # the launcher has exec'd sleep by now
    )
    subprocess.run([sys.executable, "-P", "-c", parent], check=True, timeout=60)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:  # a zombie until reaped
            if f.read().split(") ", 1)[1].startswith("Z"):
                return
        time.sleep(0.1)
    os.kill(pid, 9)
    pytest.fail("the child outlived its parent")


async def test_a_ranker_pinned_to_cpus_runs_every_thread_there(tiny_checkpoint: Path) -> None:
    """``spawn_ranker(cpus=...)``: the launcher sets the mask before exec, so the ranker's compute thread, its
    event loop and torch's threads all run only there (the serving benchmark keeps its harness off them)."""
    if sys.platform != "linux":
        pytest.skip("CPU affinity is Linux-only")
    mine = os.sched_getaffinity(0)
    target = max(mine)
    ranker = await spawn_ranker(tiny_checkpoint, ["--device", "cpu", "--threads", "1", "--max-suffix", "8"],
                                nice=5, cpus={target})
    try:
        tids = os.listdir(f"/proc/{ranker.pid}/task")
        assert len(tids) >= 2
        assert {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tids} == {(target,)}
        assert os.getpriority(os.PRIO_PROCESS, ranker.pid) >= 5  # nice(1) ran after the launcher, and still applies
    finally:
        await ranker.stop()
    assert os.sched_getaffinity(0) == mine  # the mask was set in the launcher, not here
