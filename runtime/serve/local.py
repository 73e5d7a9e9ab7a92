"""Embedded deployment on one machine: ranker replicas as child processes, the router in this process.

This is what ``grstack serve local``, the demo, the benchmark and the multi-process tests run. Rankers are
started with ``--port 0`` and report their address with one JSON line on stdout once they are ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from aiohttp import web

from grstack.runtime.errors import UserError
from grstack.runtime.serve.clock import SystemClock
from grstack.runtime.serve.router import Router, RouterConfig, start_router


@dataclass
class RankerProcess:
    proc: asyncio.subprocess.Process
    url: str
    replica: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: the crash case (no deregistration, connections reset)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                self.kill()
                await self.proc.wait()


# Started between the (v)fork and the ranker: sets PR_SET_PDEATHSIG (kept across execve), exits if the
# parent has already gone, restricts itself to the CPUs given (an affinity mask is kept across execve and
# inherited by every thread the ranker starts), then execs the ranker. Running in a fresh interpreter (-I -S:
# no site, no grstack, no gRPC), it replaces a ``preexec_fn``; see ``spawn_ranker`` for why that matters.
_DIE_WITH_PARENT = (
    "import ctypes,os,signal,sys\n"
    "try:\n ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGTERM)\n"
    "except Exception:\n pass\n"
    "if os.getppid()!=int(sys.argv[1]):\n sys.exit(70)\n"
    "if sys.argv[2]:\n os.sched_setaffinity(0,{int(c) for c in sys.argv[2].split(',')})\n"
    "os.execv(sys.argv[3],sys.argv[3:])\n")


def die_with_parent(cmd: list[str], cpus: Collection[int] | None = None) -> list[str]:
    """Linux: ``cmd`` behind a launcher so that it gets SIGTERM when this process dies (no orphaned rankers),
    pinned to ``cpus`` if given."""
    if sys.platform != "linux":
        if cpus:
            raise UserError("pinning a ranker to CPUs needs Linux (sched_setaffinity)")
        return cmd
    mask = ",".join(str(c) for c in sorted(cpus)) if cpus else ""
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), mask, *cmd]


def ranker_command(checkpoint: str | Path, args: list[str] | None = None) -> list[str]:
    return [sys.executable, "-P", "-m", "grstack.runtime.cli", "serve", "ranker", "--checkpoint", str(checkpoint),
            "--port", "0", *(args or [])]


async def spawn_ranker(checkpoint: str | Path, args: list[str] | None = None, *, timeout_s: float = 180.0,
                       stderr: IO[Any] | int | None = None, env: dict[str, str] | None = None,
                       nice: int = 0, cpus: Collection[int] | None = None) -> RankerProcess:
    """Starts ``grstack serve ranker`` and waits until it reports ready. ``nice``: its scheduling niceness
    (through ``nice(1)``, so every thread it starts has it), for a harness that shares cores with it.
    ``cpus``: the CPUs it may run on (Linux; every thread of it), so that a load generator on the same host
    has cores of its own, as on a test bed with a separate client machine."""
    full_env = {**os.environ, **(env or {})}
    cmd = ranker_command(checkpoint, args)
    if nice:
        binary = shutil.which("nice")
        if binary is None:
            raise UserError("nice(1) is not on PATH: cannot start a ranker at a lower priority")
        cmd = [binary, "-n", str(nice), *cmd]
    # No ``preexec_fn`` (nor uid/gid/groups): with one, CPython forks with fork(), which runs gRPC's
    # pthread_atfork handlers and Python's at-fork hooks in a copy of a process whose gRPC threads (an aetcd
    # client's lease keep-alive and watch) may be mid-call; the child then aborts or crashes before exec
    # ("skipping fork() handlers", "epoll_wait error: Bad file descriptor", status -6). Without one it uses
    # vfork(), or posix_spawn(), which run no at-fork handlers and no Python code: the child only execs.
    proc = await asyncio.create_subprocess_exec(*die_with_parent(cmd, cpus),
                                                stdout=asyncio.subprocess.PIPE, stderr=stderr, env=full_env)
    assert proc.stdout is not None
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
            if not line:
                await proc.wait()
                raise UserError(f"ranker for {checkpoint} exited with status {proc.returncode} before it was "
                                f"ready (see its log above)")
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if msg.get("event") == "ready":
                    return RankerProcess(proc, msg["url"], msg["replica"])
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise


@dataclass
class LocalCluster:
    """N ranker processes plus an in-process router (static replicas, in-memory placement store)."""

    checkpoint: str | Path
    replicas: int = 2
    ranker_args: list[str] = field(default_factory=list)
    router_config: RouterConfig = field(default_factory=RouterConfig)
    host: str = "127.0.0.1"
    port: int = 0
    stderr: IO[Any] | int | None = None
    rankers: list[RankerProcess] = field(default_factory=list)
    router: Router | None = None
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> LocalCluster:
        try:
            self.rankers = list(await asyncio.gather(*(
                spawn_ranker(self.checkpoint, self.ranker_args, stderr=self.stderr) for _ in range(self.replicas))))
            cfg = replace(self.router_config, rankers=tuple(r.url for r in self.rankers))
            self.router = Router(cfg, clock=SystemClock())
            self._runner, self.url = await start_router(self.router, self.host, self.port)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await asyncio.gather(*(r.stop() for r in self.rankers), return_exceptions=True)

    async def __aenter__(self) -> LocalCluster:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
