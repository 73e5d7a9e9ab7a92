"""A rank's place in the job: the torchrun-style environment, the process groups, one Comm per thread.

Groups (every rank creates every group, in the same order, as torch.distributed requires), what each
carries, and the one thread that issues on it:

* world: the dense gradients' all-reduce and the step's loss statistics; issued by the collective-issuing
  thread ``grstack-comm`` (``grstack.runtime.train.issue_queue``; inline for a one-rank job). Its gloo
  twin ``world-meta`` (host data: agreement, evaluation rounds, objects, barriers) is the main thread's;
* sparse-fwd, one per sparse group: the rows and gradients of the current batch (All2All) and the sparse
  gradient-norm all-reduce; ``grstack-comm``. Its twin ``sparse-fwd-meta``: host routing data of the batches
  routed on the main thread, and evaluation's host data;
* sparse-pre, one per sparse group: the dual-buffer prefetch's key routing (counts and keys, host data
  only); the prefetch thread ``grstack-prefetch``. On NCCL/HCCL it is a gloo group and nothing else
  (``ctx.sparse_pre.device`` is the CPU): a device communicator nobody uses is not created;
* replica, one per shard index (the same shard in every sparse group): the sparse-gradient sum across
  groups; ``grstack-comm``. Its twin ``replica-meta``: the union of the touched keys (host data).

Outside the training pipeline's steps (start-up, evaluation, export, the end of a run) the main thread
issues on the device groups itself, when nothing else is in flight. On gloo every group is a gloo group and
the twins are the groups themselves. On NCCL/HCCL the default group is gloo (it is ``world-meta``), and each
device group is created bound to the rank's accelerator (``new_group(device_id=...)``), which creates its
communicator at once; then every live device group runs one tiny all-reduce from the main thread, in the
order world, sparse-fwd, replica on every rank, so every communicator exists before any thread issues on it
(HCCL, and torch without ``device_id``, create it there). The default group is not bound to the device
(``init_process_group(device_id=...)``) on purpose: torch would then create every later group by
``ncclCommSplit`` of the default communicator, which every rank of the world must call, and for a gloo
subgroup only its non-members do (pytorch/pytorch#145376: a hang, or splits paired wrongly).

Collective timeouts (``distributed.timeout_s``, every group's timeout) must end a rank with one ``error:``
line and exit status 3 (``grstack.runtime.train.launch``). NCCL's default on a timeout (and on an error)
is to kill the process from its watchdog thread (SIGABRT, a C++ message, no Python exception), so a rank's
environment gets ``NCCL_FAILURE_ENV`` (see :func:`failure_env`) unless the user set those variables.
"""

from __future__ import annotations

import datetime
import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from grstack.runtime.device import distributed_backend, set_current_device, synchronize
from grstack.runtime.embedding import Comm
from grstack.runtime.errors import UserError

T = TypeVar("T")
ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
# on a collective timeout or error: abort the communicators and keep the process, so the error reaches Python
# (the next collective or wait on them raises; the launcher exits 3) instead of SIGABRT; no flight-recorder
# dump and no heartbeat monitor, whose remedy is SIGABRT too (the launcher's Watchdog covers hangs). No host
# sync: a blocking wait (TORCH_NCCL_BLOCKING_WAIT=1) would make every collective one.
NCCL_FAILURE_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                    "TORCH_NCCL_ENABLE_MONITORING": "0"}
_LEGACY_NAMES = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING"}


def failure_env(backend: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a rank of ``backend`` sets before creating its groups: ``NCCL_FAILURE_ENV`` on NCCL,
    less those the user set (under either name torch reads). HCCL's default already reports a timeout without
    ending the process (HCCL_ASYNC_ERROR_HANDLING=1), and the Watchdog ends the hang; gloo raises."""
    if backend != "nccl":
        return {}
    return {k: v for k, v in NCCL_FAILURE_ENV.items() if k not in environ and _LEGACY_NAMES.get(k) not in environ}


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
        """``launched``: started as a rank (a launcher or torchrun set the environment). Such a job has
        process groups even as a world of one, so every collective really runs (on NCCL/HCCL: with device
        tensors); ``single`` (a plain ``grstack train``) has none and every collective short-circuits."""
        self.env = env
        self.rank, self.world_size = env.rank, env.world_size
        self.device = device
        self.group_size = resolve_group_size(env.world_size, sparse_group_size)
        self.timeout_s = timeout_s
        self.backend = distributed_backend(device)
        self.launched = launched
        self._timeout = datetime.timedelta(seconds=timeout_s)
        if launched and not dist.is_initialized():
            set_current_device(device)
            os.environ.update(failure_env(self.backend, os.environ))
            os.environ.setdefault("MASTER_ADDR", env.master_addr)
            os.environ.setdefault("MASTER_PORT", str(env.master_port))
            # gloo: host data on NCCL/HCCL (world-meta), everything on gloo (module docstring)
            dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                    rank=env.rank, world_size=env.world_size, timeout=self._timeout)
        # collectives take tensors on the backend's device; routing metadata rides on gloo side groups
        self.comm_device = device if self.backend != "gloo" else torch.device("cpu")
        G, W = self.group_size, self.world_size
        groups = [list(range(g * G, (g + 1) * G)) for g in range(W // G)]
        replicas = [[s + g * G for g in range(W // G)] for s in range(G)]
        mine = self.rank // G
        self.sparse_ranks, self.replica_ranks = groups[mine], replicas[self.rank % G]
        self.world = self._world()
        self.sparse_fwd = [self._comm(r, "sparse-fwd") for r in groups][mine]
        self.sparse_pre = [self._comm(r, "sparse-pre", host_only=self.backend != "gloo") for r in groups][mine]
        self.replica = [self._comm(r, "replica") for r in replicas][self.rank % G]
        self._warm_up()

    def _world(self) -> Comm:
        everyone = list(range(self.world_size))
        if not self.launched:
            return Comm(None, everyone, self.rank, "world", self.comm_device, live=False)
        default_gloo = dist.get_backend() == "gloo"
        if self.backend == "gloo" and default_gloo:
            return Comm(None, everyone, self.rank, "world", self.comm_device, live=True)
        meta_pg = None if default_gloo else dist.new_group(everyone, timeout=self._timeout, backend="gloo")
        meta = Comm(meta_pg, everyone, self.rank, "world-meta", live=True)
        return Comm(self._device_group(everyone), everyone, self.rank, "world", self.comm_device, meta, live=True)

    def _device_group(self, ranks: list[int]) -> dist.ProcessGroup:
        """A group of the device backend over ``ranks``, bound to this rank's accelerator where torch can
        (its communicator is then created now, by its members)."""
        kwargs: dict[str, Any] = {}
        if self.backend != "gloo" and self.device.index is not None and _new_group_takes_device():
            kwargs["device_id"] = self.device
        return dist.new_group(ranks, timeout=self._timeout, backend=self.backend, **kwargs)

    def _comm(self, ranks: list[int], name: str, host_only: bool = False) -> Comm:
        """A Comm over ``ranks`` (every rank calls this for every group, in the same order). A group of one in
        a larger world short-circuits without a process group; ``host_only``: a gloo group alone (host data),
        on the CPU."""
        device = torch.device("cpu") if host_only else self.comm_device
        live = self.launched and (len(ranks) > 1 or self.world_size == 1)
        if not live:
            return Comm(None, [self.rank], self.rank, name, device, live=False)
        on_gloo = host_only or self.backend == "gloo"
        timeout = self._timeout
        pg = dist.new_group(ranks, timeout=timeout, backend="gloo") if on_gloo else self._device_group(ranks)
        meta_pg = None if on_gloo else dist.new_group(ranks, timeout=timeout, backend="gloo")
        if self.rank not in ranks:
            return Comm(None, [self.rank], self.rank, name, live=False)  # another rank's group: never used
        meta = Comm(meta_pg, ranks, self.rank, f"{name}-meta", live=True) if meta_pg is not None else None
        return Comm(pg, ranks, self.rank, name, device, meta, live=True)

    def _warm_up(self) -> None:
        """One tiny all-reduce on every live device group, from this (the main) thread, in the same order on
        every rank (world, then the partition into sparse groups, then the one into replica groups: no rank
        waits in one group for a rank that waits in another), so every communicator exists before any thread
        issues on it. One device sync at start-up shows a failed start here, not at the first step."""
        live = [c for c in self.device_comms if c.live]
        for comm in live:
            comm.all_reduce(torch.zeros(1, device=comm.device))
        if live:
            synchronize(self.comm_device)

    @classmethod
    def single(cls, device: torch.device, sparse_group_size: int = 0, timeout_s: float = 120.0) -> DistContext:
        """A world of one rank (a plain ``grstack train``): the same engine, no network, no process group."""
        env = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0)
        return cls(env, device, sparse_group_size, timeout_s, launched=False)

    @property
    def comms(self) -> list[Comm]:
        """Every Comm the communication log sees (``attach_log`` adds each one's gloo twin)."""
        return [self.world, self.sparse_fwd, self.sparse_pre, self.replica]

    @property
    def device_comms(self) -> list[Comm]:
        """The Comms on device communicators (NCCL/HCCL; gloo groups alike on gloo): only ``grstack-comm``
        issues on them, in program order."""
        return [self.world, self.sparse_fwd, self.replica]

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


def _new_group_takes_device() -> bool:
    """Whether ``torch.distributed.new_group`` binds a group to a device (``device_id``, torch >= 2.6)."""
    return "device_id" in inspect.signature(dist.new_group).parameters
