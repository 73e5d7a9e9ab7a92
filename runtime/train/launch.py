"""Starting ranks: ``grstack train --nproc N`` spawns N local processes; inside a pod (or under torchrun) the
environment MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK / LOCAL_RANK makes ``grstack train`` one rank.

Failure policy: a rank that loses a peer (a collective fails or waits past ``distributed.timeout_s``) or
stops making progress (a watchdog) prints one ``error:`` line naming its rank and exits at once with status
3, without waiting for threads stuck in collectives; a user error exits with status 2 on every rank. The
operator (or the local launcher) then restarts the gang, which resumes from the last complete checkpoint.

The line names the rank, the collective and its group when a collective failed (``CollectiveError``),
``distributed.timeout_s`` and the likely cause. On NCCL a timeout reaches Python as an exception (the rank's
environment is set for it: ``grstack.runtime.train.context.failure_env``); where a backend only reports it
and the rank hangs (HCCL), the Watchdog ends the rank after three timeouts without progress.

``GRSTACK_FAULT_EXIT=RANK:STEP`` makes that rank die abruptly after that global step, and
``GRSTACK_FAULT_STALL=RANK:STEP`` makes it stop making progress there, alive (tests of this path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from grstack.runtime.errors import UserError

ENV_FAULT = "GRSTACK_FAULT_EXIT"
ENV_STALL = "GRSTACK_FAULT_STALL"
ENV_ERROR_FILE = "GRSTACK_ERROR_FILE"
ENV_RESULT_FILE = "GRSTACK_RESULT_FILE"
ENV_THREADS = "GRSTACK_RANK_THREADS"
EXIT_USER, EXIT_PEER, EXIT_CRASH = 2, 3, 1
T = TypeVar("T")
_PEER_HINTS = ("gloo", "connection", "timed out", "timeout", "closed", "nccl", "hccl", "socket", "peer",
               "broken pipe", "reset")


class PeerFailure(UserError):
    """A rank of the job died or hung; every rank exits so the gang can be restarted."""

    exit_code = EXIT_PEER


def is_peer_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    from grstack.runtime.embedding import CollectiveError

    if isinstance(exc, CollectiveError):
        exc = exc.cause
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(h in text for h in _PEER_HINTS)


def peer_failure_message(rank: int, exc: BaseException, timeout_s: float | None = None) -> str:
    """The one line of a rank that lost a peer: the collective and group that saw it (when one did), the
    timeout, the likely cause and what happens next."""
    from grstack.runtime.embedding import CollectiveError

    cause = exc.cause if isinstance(exc, CollectiveError) else exc
    lines = str(cause).strip().splitlines()
    first = lines[0][:200] if lines else type(cause).__name__
    where = f"{exc.op} on group {exc.group}: " if isinstance(exc, CollectiveError) else ""
    limit = f" within distributed.timeout_s={timeout_s:g}" if timeout_s is not None else ""
    return (f"rank {rank}: lost contact with a peer ({where}{first}); a peer likely died or stalled (a collective "
            f"that does not complete{limit} fails); every rank exits so the job can be restarted from its last "
            "checkpoint")


class Watchdog:
    """Exits the process when no heartbeat arrives for ``limit_s`` (a hang that no collective timeout sees)."""

    def __init__(self, rank: int, limit_s: float, timeout_s: float | None = None) -> None:
        self.rank, self.limit_s, self.timeout_s = rank, limit_s, timeout_s
        self.last = time.monotonic()
        self.fault = _parse_fault(os.environ.get(ENV_FAULT, ""), rank)
        self.stall = _parse_fault(os.environ.get(ENV_STALL, ""), rank)
        threading.Thread(target=self._watch, name="grstack-watchdog", daemon=True).start()

    def beat(self, step: int | None = None) -> None:
        self.last = time.monotonic()
        if self.fault is not None and step is not None and step >= self.fault:
            print(f"grstack: fault injection: rank {self.rank} exits abruptly after step {step}", file=sys.stderr,
                  flush=True)
            os._exit(17)
        if self.stall is not None and step is not None and step >= self.stall:
            print(f"grstack: fault injection: rank {self.rank} stalls after step {step}", file=sys.stderr,
                  flush=True)
            while True:  # alive, silent, no progress: only the Watchdog (or a kill) ends it
                time.sleep(3600)

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.limit_s / 4))
            idle = time.monotonic() - self.last
            if idle > self.limit_s:
                t = self.timeout_s
                limit = f" ({self.limit_s / t:g} x distributed.timeout_s={t:g})" if t is not None else ""
                _die(EXIT_PEER, f"rank {self.rank}: no progress for {idle:.0f} s{limit}: a peer likely died or "
                                "stalled, or a collective hangs; exiting so the job can be restarted from its last "
                                "checkpoint")


def _parse_fault(spec: str, rank: int) -> int | None:
    if not spec:
        return None
    r, _, step = spec.partition(":")
    return int(step) if int(r) == rank else None


def _die(code: int, message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    path = os.environ.get(ENV_ERROR_FILE)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(message)
    sys.stdout.flush()
    os._exit(code)


def guarded(rank: int, fn: Callable[[], T], timeout_s: float | None = None) -> T:
    """Runs ``fn``; any failure prints one line and ends the process with the policy's exit status
    (``timeout_s``: the job's distributed.timeout_s, named in a lost peer's line)."""
    try:
        return fn()
    except PeerFailure as exc:
        _die(EXIT_PEER, f"rank {rank}: {exc}")
    except UserError as exc:
        _die(EXIT_USER, f"rank {rank}: {exc}")
    except BaseException as exc:
        if is_peer_failure(exc):
            _die(EXIT_PEER, peer_failure_message(rank, exc, timeout_s))
        traceback.print_exc()
        _die(EXIT_CRASH, f"rank {rank}: {type(exc).__name__}: {exc}")
    raise AssertionError("unreachable")


def rank_device(cfg: Any, env: Any) -> Any:
    import torch

    from grstack.runtime.device import local_device, resolve_device

    threads = os.environ.get(ENV_THREADS)
    if threads and not cfg.train.num_threads:
        torch.set_num_threads(int(threads))
    return local_device(resolve_device(cfg.train.device), env.local_rank)


def run_rank(cfg: Any, run_dir: str | Path, env: Any, *, progress: bool = True,
             stop_after: int | None = None) -> dict[str, Any]:
    """Runs this process as one rank; failures end the process (see the module docstring)."""

    def train() -> dict[str, Any]:
        from grstack.runtime.train.context import DistContext
        from grstack.runtime.train.trainer import Trainer

        ctx = DistContext(env, rank_device(cfg, env), cfg.distributed.sparse_group_size,
                          cfg.distributed.timeout_s)
        watchdog = Watchdog(env.rank, 3 * cfg.distributed.timeout_s, cfg.distributed.timeout_s)
        return Trainer(cfg, run_dir, ctx, progress=progress, stop_after=stop_after,
                       heartbeat=watchdog.beat).run()

    result = guarded(env.rank, train, cfg.distributed.timeout_s)
    path = os.environ.get(ENV_RESULT_FILE)
    if path and env.local_rank == 0:  # the local gang's first rank (global rank 0 when alone)
        Path(path).write_text(json.dumps(result))
    return result


# -- local launcher ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Node:
    """This pod's place in a multi-pod job started with ``--nproc N`` in each pod (GRTrainingJob
    ``nprocPerNode``): its local ranks are global ranks ``base .. base + N - 1`` of ``world_size``."""

    master_addr: str
    master_port: int
    world_size: int
    base: int


def node_from_env(nproc: int, environ: Mapping[str, str] | None = None) -> Node | None:
    """The torchrun environment of a pod running ``nproc`` local ranks, or None outside one. The pod's env is
    that of its local rank 0: WORLD_SIZE = all ranks, NODE_RANK (or GROUP_RANK) = the pod's index, RANK =
    NODE_RANK * nproc, LOCAL_WORLD_SIZE = nproc."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", nproc))
        node = env.get("NODE_RANK", env.get("GROUP_RANK"))
        base = int(node) * nproc if node is not None else int(env.get("RANK", "0"))
        out = Node(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, base)
    except (KeyError, ValueError) as exc:
        raise UserError(f"--nproc {nproc} inside a distributed job: incomplete or bad environment ({exc})") from None
    if local_world != nproc:
        raise UserError(f"--nproc {nproc} inside a distributed job with LOCAL_WORLD_SIZE={local_world}: they must "
                        "agree (one process per local rank)")
    if "RANK" in env and int(env["RANK"]) != base:
        raise UserError(f"RANK={env['RANK']} is not NODE_RANK * --nproc = {base}: the pod's RANK is that of its "
                        "first local rank")
    if world % nproc or not 0 <= base <= world - nproc:
        raise UserError(f"--nproc {nproc} ranks from RANK={base} do not fit in WORLD_SIZE={world}")
    return out


def rank_env(rank: int, nproc: int, port: int, threads: int | None = None,
             node: Node | None = None) -> dict[str, str]:
    """Local rank ``rank`` of ``nproc``: alone on this machine, or (``node``) part of a multi-pod job."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc), "RANK": str(rank),
           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc)}
    if node is not None:
        env.update({"MASTER_ADDR": node.master_addr, "MASTER_PORT": str(node.master_port),
                    "WORLD_SIZE": str(node.world_size), "RANK": str(node.base + rank),
                    "NODE_RANK": str(node.base // nproc), "GROUP_RANK": str(node.base // nproc)})
    if threads:
        env[ENV_THREADS] = str(threads)
    return env


def spawn_local(nproc: int, argv: list[str], tmp: Path, extra_env: dict[str, str] | None = None,
                per_rank_env: dict[int, dict[str, str]] | None = None, node: Node | None = None
                ) -> list[subprocess.Popen]:
    """Starts ``python -m <argv>`` as ``nproc`` local ranks with the torchrun environment."""
    port = node.master_port if node is not None else free_port()
    threads = max(1, (os.cpu_count() or 1) // nproc)
    procs = []
    for r in range(nproc):
        env = {**os.environ, **(extra_env or {}), **rank_env(r, nproc, port, threads, node),
               ENV_ERROR_FILE: str(tmp / f"error-{r}.txt"), **((per_rank_env or {}).get(r, {}))}
        if r == 0:
            env[ENV_RESULT_FILE] = str(tmp / "result.json")
        procs.append(subprocess.Popen([sys.executable, "-P", "-m", *argv], env=env))
    return procs


def wait_all(procs: list[subprocess.Popen], grace_s: float, limit_s: float | None = None) -> list[int]:
    """Waits for every rank; once one fails, the others get ``grace_s`` to exit on their own, then are killed
    (as is everything still running after ``limit_s``)."""
    start = time.monotonic()
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        late = limit_s is not None and time.monotonic() - start > limit_s
        if late or (failed_at is not None and time.monotonic() - failed_at > grace_s):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)


def failure_message(codes: list[int], tmp: Path) -> tuple[int, str]:
    """The most useful error of a failed gang: a user error first, then the first rank that died."""
    messages = {}
    for r, code in enumerate(codes):
        f = tmp / f"error-{r}.txt"
        if f.is_file():
            messages[r] = f.read_text().strip()
        elif code != 0:
            messages[r] = f"rank {r} exited with status {code}" + (" (killed by a signal)" if code < 0 else "")
    users = [r for r, c in enumerate(codes) if c == EXIT_USER and r in messages]
    if users:
        return EXIT_USER, messages[users[0]]
    dead = [r for r, c in enumerate(codes) if c not in (0, EXIT_PEER, EXIT_USER)]
    first = dead[0] if dead else min(messages)
    others = sorted(set(messages) - {first})
    note = f"; the other ranks stopped ({', '.join(messages[r] for r in others)})" if others else ""
    return EXIT_PEER, messages[first] + note


def preflight(cfg: Any, nproc: int, world: int | None = None) -> None:
    """What can be checked before any rank starts, so a mistake is one clear error, not a gang of failing
    ranks: the world size against the sharding plan and the batch, the precision against the device, the
    local ranks against the accelerators."""
    from grstack.runtime.data import known_item_count
    from grstack.runtime.device import check_precision, local_device, resolve_device
    from grstack.runtime.embedding import ShardingPlan
    from grstack.runtime.train.context import resolve_group_size
    from grstack.runtime.training_config import check_catalogue

    if nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}")
    local, nproc = nproc, world or nproc  # the global checks use every rank of the job
    group = resolve_group_size(nproc, cfg.distributed.sparse_group_size)
    if cfg.balance.token_budget is None and cfg.train.batch_size < nproc:
        raise UserError(f"train.batch_size={cfg.train.batch_size} is the global batch: it must be at least the "
                        f"number of ranks ({nproc})")
    check_device_index(cfg.train.device, local)
    device = resolve_device(cfg.train.device)
    check_precision(device, cfg.train.precision)
    local_device(device, local - 1)  # every local rank needs an accelerator of its own
    items = known_item_count(cfg.data)
    if items is not None:
        ShardingPlan.make(items + 1, cfg.model.d_model, nproc, group, cfg.distributed.max_shard_rows)
        check_catalogue(cfg, items, f"data.source {cfg.data.source}")
    if cfg.data.read == "shard":  # every rank needs a piece of the data (from the files' metadata alone)
        from grstack.runtime.data import deal, list_pieces

        deal(list_pieces(cfg.data.source, nproc), nproc)


def check_device_index(name: str, local_ranks: int) -> None:
    """An accelerator index (``cuda:0``, ``npu:1``) with several local ranks would put them all on that one
    accelerator: a user error, told from the config string alone (no device needed to check it)."""
    kind, sep, _ = name.partition(":")
    if sep and kind in ("cuda", "npu") and local_ranks > 1:
        raise UserError(f"train.device={name} with --nproc {local_ranks}: each local rank takes its own "
                        f"accelerator (local rank i uses {kind}:i); use train.device={kind}")


def train_distributed(cfg: Any, run_dir: str | Path, nproc: int = 2, progress: bool = True,
                      stop_after: int | None = None, node: Node | None = None) -> dict[str, Any]:
    """Trains ``cfg`` on ``nproc`` local ranks (gloo on CPU); returns local rank 0's summary (or
    ``{"stopped_at_step": N}``). Failures raise UserError (exit status 2) or PeerFailure (3), one line each.
    With ``node`` the local ranks are this pod's share of a multi-pod job (see ``node_from_env``)."""
    preflight(cfg, nproc, node.world_size if node is not None else None)
    with tempfile.TemporaryDirectory(prefix="grstack-launch-") as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
        argv = ["grstack.runtime.train.launch", "--config-json", str(tmp / "config.json"), "--out", str(run_dir)]
        if stop_after is not None:
            argv += ["--stop-after-step", str(stop_after)]
        if not progress:
            argv.append("--no-progress")
        procs = spawn_local(nproc, argv, tmp, node=node)
        try:
            codes = wait_all(procs, grace_s=cfg.distributed.timeout_s + 15)
        except KeyboardInterrupt:
            for p in procs:
                p.terminate()
            raise
        if any(codes):
            code, message = failure_message(codes, tmp)
            raise (UserError if code == EXIT_USER else PeerFailure)(message)
        return json.loads((tmp / "result.json").read_text())


def call_ranks(target: str, nproc: int, payload: Any, *, limit_s: float = 600.0, grace_s: float = 30.0,
               env: dict[str, str] | None = None, per_rank_env: dict[int, dict[str, str]] | None = None
               ) -> list[Any]:
    """Runs ``module:function(env, payload)`` on ``nproc`` local ranks and returns each rank's result
    (benchmarks and multi-process tests). A failure raises UserError / PeerFailure with the rank's message."""
    import torch

    with tempfile.TemporaryDirectory(prefix="grstack-call-") as tmpdir:
        tmp = Path(tmpdir)
        torch.save(payload, tmp / "payload.pt")
        argv = ["grstack.runtime.train.launch", "--call", target, "--payload", str(tmp / "payload.pt"),
                "--result-dir", str(tmp)]
        procs = spawn_local(nproc, argv, tmp, extra_env=env, per_rank_env=per_rank_env)
        try:
            codes = wait_all(procs, grace_s=grace_s, limit_s=limit_s)
        except KeyboardInterrupt:
            for p in procs:
                p.terminate()
            raise
        if any(codes):
            code, message = failure_message(codes, tmp)
            raise (UserError if code == EXIT_USER else PeerFailure)(message)
        # results of arbitrary functions, written by this call's own ranks into its private temporary folder
        return [torch.load(tmp / f"result-{r}.pt", weights_only=False) for r in range(nproc)]


def main(argv: list[str] | None = None) -> int:
    """One rank of a local gang (started by ``spawn_local``): a training run, or ``--call`` a function."""
    from grstack.runtime.train.context import DistEnv
    from grstack.runtime.training_config import Config

    ap = argparse.ArgumentParser(prog="python -m grstack.runtime.train.launch")
    ap.add_argument("--config-json")
    ap.add_argument("--out")
    ap.add_argument("--stop-after-step", type=int, default=None)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--call", metavar="MODULE:FUNCTION")
    ap.add_argument("--payload")
    ap.add_argument("--result-dir")
    args = ap.parse_args(argv)
    env = DistEnv.from_env()
    if env is None:
        _die(EXIT_USER, "not started as a rank: WORLD_SIZE is not set")
    if args.call:
        import importlib

        import torch

        def call() -> Any:
            module, _, name = args.call.partition(":")
            fn = getattr(importlib.import_module(module), name)
            # the caller's own payload (call_ranks): whoever names the file also names the function to run
            return fn(env, torch.load(args.payload, weights_only=False))

        result = guarded(env.rank, call)
        torch.save(result, Path(args.result_dir) / f"result-{env.rank}.pt")
    else:
        try:
            cfg = Config.model_validate(json.loads(Path(args.config_json).read_text()))
        except (OSError, ValueError) as exc:
            _die(EXIT_USER, f"rank {env.rank}: cannot read the config: {exc}")
        run_rank(cfg, args.out, env, progress=not args.no_progress, stop_after=args.stop_after_step)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # collective threads and gloo teardown must not delay the exit


if __name__ == "__main__":
    sys.exit(main())
