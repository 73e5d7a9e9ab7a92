"""A rank's place in the job: the torchrun-style environment, the process groups, one Comm per thread.

Groups (every rank creates every group, in the same order, as torch.distributed requires):

* the world group: dense all-reduce, agreement, evaluation (the main thread);
* two copies of each sparse group: one for the frozen-window communication thread (rows and gradients of
  the current batch), one for the dual-buffer prefetch thread (keys of the next batch), so the two threads
  never interleave collectives on one group;
* replica groups (same shard index in every sparse group): the sparse-gradient sum across groups.

On NCCL/HCCL every group also has a gloo twin over the same ranks for host data (routing metadata, sizes,
objects); see ``grstack.runtime.embedding.Comm``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from grstack.runtime.device import distributed_backend, set_current_device
from grstack.runtime.embedding import Comm
from grstack.runtime.errors import UserError

T = TypeVar("T")
ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DistEnv | None:
        """The torchrun environment, or None when WORLD_SIZE is unset (a plain single-process run)."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return None
        missing = [k for k in ENV_KEYS if k not in env and k != "LOCAL_RANK"]
        if missing:
            raise UserError(f"distributed environment incomplete: {', '.join(missing)} not set "
                            f"(a torchrun-style job sets {', '.join(ENV_KEYS)})")
        try:
            out = cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                      local_rank=int(env.get("LOCAL_RANK", "0")), master_addr=env["MASTER_ADDR"],
                      master_port=int(env["MASTER_PORT"]))
        except ValueError as exc:
            raise UserError(f"distributed environment: {exc}") from None
        if not 0 <= out.rank < out.world_size:
            raise UserError(f"RANK={out.rank} is outside WORLD_SIZE={out.world_size}")
        return out


def resolve_group_size(world_size: int, sparse_group_size: int) -> int:
    group = sparse_group_size or world_size
    if group > world_size or world_size % group:
        raise UserError(f"distributed.sparse_group_size={sparse_group_size} must divide the number of ranks "
                        f"({world_size})")
    return group


class DistContext:
    def __init__(self, env: DistEnv, device: torch.device, sparse_group_size: int, timeout_s: float,
                 launched: bool = True) -> None:
        """``launched``: started as a rank (a launcher or torchrun set the environment). Such a job has a
        process group even as a world of one, so every collective really runs (on NCCL/HCCL: with device
        tensors); ``single`` (a plain ``grstack train``) has none and every collective short-circuits."""
        self.env = env
        self.rank, self.world_size = env.rank, env.world_size
        self.device = device
        self.group_size = resolve_group_size(env.world_size, sparse_group_size)
        self.timeout_s = timeout_s
        self.backend = distributed_backend(device)
        self.launched = launched
        timeout = datetime.timedelta(seconds=timeout_s)
        if launched and not dist.is_initialized():
            set_current_device(device)
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
            dist.init_process_group(self.backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                    rank=env.rank, world_size=env.world_size, timeout=timeout)
        # collectives take tensors on the backend's device; routing metadata rides on gloo side groups
        self.comm_device = device if self.backend != "gloo" else torch.device("cpu")
        G, W = self.group_size, self.world_size
        groups = [list(range(g * G, (g + 1) * G)) for g in range(W // G)]
        replicas = [[s + g * G for g in range(W // G)] for s in range(G)]
        mine = self.rank // G
        self.sparse_ranks, self.replica_ranks = groups[mine], replicas[self.rank % G]
        made: dict[str, Comm] = {}
        for name in ("fwd", "pre"):
            for g, ranks in enumerate(groups):
                comm = self._comm(ranks, f"sparse-{name}", timeout)
                if g == mine:
                    made[name] = comm
        for s, ranks in enumerate(replicas):
            comm = self._comm(ranks, "replica", timeout)
            if s == self.rank % G:
                made["replica"] = comm
        world_meta = None
        if launched and self.backend != "gloo":
            world_meta = Comm(dist.new_group(list(range(W)), timeout=timeout, backend="gloo"), list(range(W)),
                              self.rank, "world-meta", live=True)
        self.world = Comm(None, list(range(W)), self.rank, "world", self.comm_device, world_meta, live=launched)
        self.sparse_fwd, self.sparse_pre, self.replica = made["fwd"], made["pre"], made["replica"]

    def _comm(self, ranks: list[int], name: str, timeout: datetime.timedelta) -> Comm:
        """A Comm over ``ranks`` (every rank calls this for every group, in the same order). A group of one in
        a larger world short-circuits without a process group."""
        live = self.launched and (len(ranks) > 1 or self.world_size == 1)
        if not live:
            return Comm(None, [self.rank], self.rank, name, self.comm_device, live=False)
        pg = dist.new_group(ranks, timeout=timeout, backend=self.backend)
        meta_pg = dist.new_group(ranks, timeout=timeout, backend="gloo") if self.backend != "gloo" else None
        if self.rank not in ranks:
            return Comm(None, [self.rank], self.rank, name, live=False)  # another rank's group: never used
        meta = Comm(meta_pg, ranks, self.rank, f"{name}-meta", live=True) if meta_pg is not None else None
        return Comm(pg, ranks, self.rank, name, self.comm_device, meta, live=True)

    @classmethod
    def single(cls, device: torch.device, sparse_group_size: int = 0, timeout_s: float = 120.0) -> DistContext:
        """A world of one rank (a plain ``grstack train``): the same engine, no network, no process group."""
        env = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0)
        return cls(env, device, sparse_group_size, timeout_s, launched=False)

    @property
    def comms(self) -> list[Comm]:
        return [self.world, self.sparse_fwd, self.sparse_pre, self.replica]

    def agree(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on rank 0 only; a UserError there is raised on every rank (nobody waits forever)."""
        result: Any = None
        error = None
        if self.rank == 0:
            try:
                result = fn()
            except UserError as exc:
                error = exc.message
        result, error = self.world.broadcast_object((result, error))
        if error is not None:
            raise UserError(error)
        return result

    def check_all(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on every rank; if any raises a UserError, every rank raises the first one."""
        result: Any = None
        error = None
        try:
            result = fn()
        except UserError as exc:
            error = exc.message
        errors = [e for e in self.world.all_gather_object(error) if e is not None]
        if errors:
            raise UserError(errors[0])
        return result

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
