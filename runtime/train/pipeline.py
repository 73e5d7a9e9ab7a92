"""One training step of the distributed engine, with nested pipelining (docs/architecture.md §4.4-4.6).

The five stages of a batch: (1) data prefetch — ``BatchStream`` prepares batches in a thread; (2) H2D —
the prepared tensors move to the device; (3) key routing — dedupe, bucket by owner, All2All of keys;
(4) retrieval — the owner reads the requested rows from its shard (the store) into the batch buffer;
(5) forward/backward — rows All2All to the requesters, compute, gradients All2All to the owners, dense
all-reduce, sparse and dense updates.

* Synchronous (``pipeline.dbp`` off): stages 3-4 run at the start of the step.
* Dual-buffer (``dbp``): stages 3-4 of batch t+1 run in the prefetch thread while t computes; before t+1
  uses its buffer, rows that t's update changed are refreshed from the update's output (``refresh``).
  Every number equals the synchronous loop's, bit for bit.
* Frozen-window (``microbatches`` N): parameters do not change inside a batch, so the communication thread
  moves the rows of micro-batch m+1 and the gradients of m-1 while the main thread computes m; one update
  per batch. Results equal N=1 up to the order of gradient sums.
* Semi-asynchronous (``semi_async``): the prefetch thread also returns t+1's rows before t's update (they
  are read before it: at most one step stale, counted in ``stale_rows``); nothing is refreshed. The rows
  wait in ``HostOffload`` (host memory; negatives in FP16 with ``negatives.fp16``). A resumed semi-async run
  reads its first batch fresh, so unlike the other modes it does not repeat the interrupted run bit for bit.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from grstack.runtime.embedding import ActiveRows, RoutedBatch, ShardedEmbedding, merge_rows
from grstack.runtime.train.balance import imbalance, measured_balance, wait_ratio
from grstack.runtime.train.batching import MicroBatch, PreparedBatch
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.negatives import GroupLayout, HostOffload, sampled_softmax_sum
from grstack.runtime.train.timing import CommClock
from grstack.runtime.training_config import Config


@dataclass
class _Pending:
    step: int
    future: Future
    retrieved: threading.Event
    parked: list[int] = field(default_factory=list)


def _dev(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host batch data on ``device``: an asynchronous copy (a blocking one would wait for the device)."""
    return t if t.device == device else t.to(device, non_blocking=True)


def _take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` for an index of any shape, through index_select: its backward is one index_add
    (advanced indexing's backward is a much slower accumulate-put on CPU)."""
    return rows.index_select(0, index.reshape(-1)).reshape(*index.shape, rows.shape[-1])


class _Inline:
    """An executor that runs each call at once in the caller's thread (a one-rank job's comm "thread")."""

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        return None


class Engine:
    def __init__(self, cfg: Config, ctx: DistContext, model: nn.Module, table: ShardedEmbedding,
                 device: torch.device) -> None:
        self.cfg, self.ctx, self.model, self.table, self.device = cfg, ctx, model, table, device
        self.dense_params = [p for p in model.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.dense_params, lr=o.lr, betas=(o.beta1, o.beta2),
                                           weight_decay=o.weight_decay)
        p = cfg.pipeline
        self.prefetching = p.dbp or p.semi_async
        self.ranking = getattr(model, "rank_head", None) is not None and cfg.loss.ranking_weight > 0
        self.exposures = self.ranking and cfg.loss.ranking_on == "exposures"
        # one rank has nothing to overlap with: its lookups and gradient sends run inline
        self.comm_pool: ThreadPoolExecutor | _Inline = (
            ThreadPoolExecutor(1, thread_name_prefix="grstack-comm") if ctx.sparse_fwd.live else _Inline())
        self.pre_pool = ThreadPoolExecutor(1, thread_name_prefix="grstack-prefetch")
        self.offload = HostOffload(device, cfg.negatives.fp16)
        self.active: ActiveRows | None = None
        self.pending: _Pending | None = None
        # gradients of looked-up rows go where the table lives (the owner accumulates them there)
        self.comm_device = table.weight.device
        self.sparse_base_lr = table.optimizer.lr
        self.bf16 = cfg.train.precision == "bf16"
        # gradient accumulation: this rank's (sorted local keys, summed gradient) of the window so far
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None
        self._window_open = False
        # communication events and the main thread's waits on them (exposed_comm_ms, comm_ms, busy_ms)
        self.clock = CommClock()

    # -- stages 3-4 (and, semi-async, the rows) of a batch --------------------------------------------------
    def _lookup(self, batch: PreparedBatch, pending: _Pending | None) -> RoutedBatch:
        comm = self.ctx.sparse_pre if pending is not None else self.ctx.sparse_fwd
        rb = self.table.route(batch.units, comm)
        self.table.retrieve(rb)
        if pending is not None:
            pending.retrieved.set()
            if self.cfg.pipeline.semi_async:
                fp16 = self.cfg.negatives.fp16
                for u, unit in enumerate(batch.units):
                    rows = self.table.send_rows(rb, unit, comm, fp16)
                    pending.parked.append(self.offload.park(rows, half=u == batch.neg_unit))
        return rb

    def _start_prefetch(self, batch: PreparedBatch) -> None:
        pending = _Pending(step=batch.global_step, future=Future(), retrieved=threading.Event())
        pending.future = self.pre_pool.submit(self.clock.task, self._lookup, batch, pending)
        self.pending = pending

    # -- stage 5 --------------------------------------------------------------------------------------------
    def _forward(self, batch: PreparedBatch, mb: MicroBatch, rows: torch.Tensor,
                 neg_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The micro-batch's loss, and its retrieval and ranking parts (detached, on the device: reading them
        on the host would cost a sync per micro-batch). Dense compute runs under autocast with
        ``train.precision=bf16``; the loss is computed in fp32 from fp32 copies of its inputs."""
        cfg, dev = self.cfg, self.device
        full = mb.full.to(dev, non_blocking=True)
        item_rows, context_rows = self.model.looked_rows(full, _take(rows, _dev(mb.inv_input, dev)))
        hist_at = cand_at = None
        if mb.is_hist is not None:  # positions split on the host (Preparer): a device mask would cost a sync
            assert mb.hist_index is not None and mb.cand_index is not None
            hist_at, cand_at = _dev(mb.hist_index, dev), _dev(mb.cand_index, dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = self.model.encode(full, item_rows=item_rows,
                                    **({"context_rows": context_rows} if context_rows is not None else {}))
            hist_out = out.index_select(0, hist_at) if hist_at is not None else out
            q = self.model.query_vectors(hist_out)
            # normalised once per looked-up row, then gathered: with a negative set per token the gathered
            # [N, R, d] is ~100x the unique rows, and normalising it (and its backward) dominated the step
            normed = self.model.item_vectors(rows=rows)
            pos = _take(normed, _dev(mb.inv_target, dev))
            if mb.inv_neg is not None:
                neg = _take(normed, _dev(mb.inv_neg, dev))
                neg_ids = _dev(mb.neg_ids, dev)
            else:
                assert neg_rows is not None and batch.inv_batch_neg is not None and batch.batch_neg_ids is not None
                neg = _take(self.model.item_vectors(rows=neg_rows), _dev(batch.inv_batch_neg, dev))
                neg_ids = _dev(batch.batch_neg_ids, dev)
            logits = None
            if self.ranking and mb.labels is not None and cand_at is not None:
                cand_out = out.index_select(0, cand_at)
                logits = self.model.rank_logits(cand_out, _dev(mb.cand_ids.reshape(-1), dev),
                                                cand_rows=item_rows.index_select(0, cand_at))
        share = [_dev(p, dev) for p in mb.share]
        group_of = layout = None
        if mb.neg_group is not None:
            layout = mb.neg_layout if mb.neg_layout is not None else GroupLayout.of(mb.neg_group)
            group_of = _dev(mb.neg_group, dev)
        ret = sampled_softmax_sum(q.float(), pos.float(), neg.float(), _dev(mb.targets, dev), neg_ids,
                                  cfg.loss.temperature, group_of, share, layout)
        ret = ret / batch.global_tokens
        loss = ret
        rank_t = None
        if logits is not None:
            T = mb.labels.shape[-1]
            labels = _dev(mb.labels.reshape(-1, T), dev)
            if self.exposures:  # every logged exposure was shown: task 0 ("next") is not trained
                logits, labels, T = logits[:, 1:], labels[:, 1:], T - 1
            bce = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="sum")
            rank_t = bce / (batch.global_cands * T)
            loss = loss + cfg.loss.ranking_weight * rank_t
            rank_t = rank_t.detach()
        return loss, ret.detach(), rank_t

    def step(self, batch: PreparedBatch, upcoming: PreparedBatch | None, lr: float, *, update: bool = True,
             grad_scale: float = 1.0) -> dict[str, Any]:
        """One batch: forward, backward, gradients to their owners. With ``update`` (the last batch of a
        gradient-accumulation window, or every batch without accumulation) also the dense all-reduce, the
        replica sum and both optimizers; otherwise the gradients are kept and summed with the next batch's.
        ``grad_scale`` multiplies this batch's gradients (1 / the window's batches: the update is the mean).

        Timing figures of the returned dict (communication events: ``grstack.runtime.train.timing``):

        * ``busy_ms``: this rank's own work from the step's start until it is ready to enter the dense
          all-reduce (the stats all-reduce on a step without an update): the step's time up to that point
          minus the time the main thread was blocked on communication in it (waiting for the batch's lookup,
          its rows, its gradient sends; at world size 1, running them inline). So it counts forward and
          backward and the host work of the step (moving rows to the device, the dual-buffer refresh or the
          semi-async staleness count, starting the next prefetch, merging the accumulation window's sparse
          gradients). It does not count the waits: a
          collective (an All2All of rows or gradients) returns only when every rank has entered it, so a
          fast rank waits for a slow one inside those waits, and counting them would make every rank's busy
          time equal to the slowest one's. The sparse replica sum and update run after the all-reduce's
          launch (overlapping it) and are not counted.
        * ``busy_ms_max``, ``wait_ratio_measured``, ``imbalance_measured``: from every rank's busy time of
          this step (``balance.measured_balance``), gathered in the stats that ride along the all-reduce.
          ``busy_cpu_ms``: the main thread's CPU time over the same span (this rank's only): its work without
          the time the OS gave to other processes (with one intra-op thread, as in ``bench train``). On an
          accelerator both are host times: kernels run asynchronously.
        * ``sync_wait_ms``: the time the main thread was blocked at the synchronisation point (the dense
          all-reduce's wait, or the stats all-reduce on a step without an update).
        * ``comm_ms`` / ``exposed_comm_ms``: the step's communication events inside the step, and the part of
          them during which the main thread was blocked (``timing``); ``collective_ms``: the time spent inside
          collectives (``Comm`` counters, every thread), whatever the main thread did meanwhile.
        * ``imbalance``, ``imbalance_count_split``, ``wait_ratio``: the cost model's figures (per-rank cost
          a·L + b·L² of the split used, and of the equal-count split), not measurements.
        """
        cfg, ctx, table = self.cfg, self.ctx, self.table
        clock = self.clock
        clock.start()
        t_start = time.perf_counter()
        cpu_start = time.thread_time()
        comm_before = sum(c.seconds for c in ctx.comms)
        compute = 0.0
        fp16 = cfg.negatives.fp16
        semi = cfg.pipeline.semi_async
        pending = self.pending if self.pending is not None and self.pending.step == batch.global_step else None
        self.pending = None
        stale = 0
        if pending is not None:
            rb = clock.wait(pending.future.result)
            if semi:
                stale = 0 if self.active is None else table.overlap(rb, self.active)[0].numel()
            else:
                table.refresh(rb, self.active)
        else:
            rb = clock.wait(self.comm_pool.submit(clock.task, self._lookup, batch, None).result)
        semi_rows = pending is not None and semi
        if self.prefetching and upcoming is not None:
            self._start_prefetch(upcoming)

        if self._window_open is False:  # the first batch of an accumulation window
            self.optimizer.zero_grad(set_to_none=True)
            self._window_open = True

        def fetch(u: int) -> Future:
            return self.comm_pool.submit(clock.task, table.send_rows, rb, batch.units[u], ctx.sparse_fwd, fp16)

        def rows_of(u: int, fut: Future | None) -> torch.Tensor:
            if semi_rows:
                return self.offload.take(pending.parked[u])
            assert fut is not None
            return clock.wait(fut.result).to(self.device, non_blocking=True)

        n = len(batch.micro)
        futures: dict[int, Future] = {}
        if not semi_rows:
            if batch.neg_unit is not None:
                futures[batch.neg_unit] = fetch(batch.neg_unit)
            futures[batch.micro[0].unit] = fetch(batch.micro[0].unit)
        neg_leaf = None
        grad_futures: list[Future] = []
        zero = torch.zeros((), device=self.device)
        ret_total, rank_total = zero, zero
        for m, mb in enumerate(batch.micro):
            if batch.neg_unit is not None and neg_leaf is None:
                neg_leaf = rows_of(batch.neg_unit, futures.get(batch.neg_unit)).requires_grad_(True)
            leaf = rows_of(mb.unit, futures.get(mb.unit)).requires_grad_(True)
            if m + 1 < n:
                if semi_rows:
                    self.offload.prefetch(pending.parked[batch.micro[m + 1].unit])
                else:
                    futures[batch.micro[m + 1].unit] = fetch(batch.micro[m + 1].unit)
            t0 = time.perf_counter()
            loss, ret_part, rank_part = self._forward(batch, mb, leaf, neg_leaf)
            (loss * grad_scale if grad_scale != 1.0 else loss).backward()
            compute += time.perf_counter() - t0
            ret_total = ret_total + ret_part
            if rank_part is not None:
                rank_total = rank_total + rank_part
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            grad_futures.append(self.comm_pool.submit(clock.task, table.send_grads, rb, batch.units[mb.unit],
                                                      grad.to(self.comm_device), ctx.sparse_fwd))
        if batch.neg_unit is not None:
            assert neg_leaf is not None
            grad = neg_leaf.grad if neg_leaf.grad is not None else torch.zeros_like(neg_leaf)
            grad_futures.append(self.comm_pool.submit(clock.task, table.send_grads, rb,
                                                      batch.units[batch.neg_unit], grad.to(self.comm_device),
                                                      ctx.sparse_fwd))
        for f in grad_futures:
            clock.wait(f.result)
        assert rb.grad is not None
        keys, local_grad = rb.keys, rb.grad
        if self.held is not None:  # earlier batches of this accumulation window
            keys, local_grad = merge_rows(self.held[0], self.held[1], keys, local_grad)
        # ready for the all-reduce: this rank's busy seconds go in its own slot of the stats (the sum over
        # ranks then holds every rank's; no extra collective)
        W = ctx.world_size
        busy = time.perf_counter() - t_start - clock.blocked_s()
        busy_cpu = time.thread_time() - cpu_start
        slots = [0.0] * W
        slots[ctx.rank] = busy
        extra = torch.tensor([float(rb.refreshed), float(stale), *slots], device=self.device)
        stats = torch.cat([ret_total.reshape(1), rank_total.reshape(1), extra]).to(ctx.comm_device)
        update_s = 0.0
        waited = clock.blocked_s()  # the waits before the synchronisation point
        if not update:
            self.held = (keys, local_grad)
            self.active = None  # nothing was written: the next prefetched rows need no refresh
            if ctx.world.live:
                clock.wait(ctx.world.all_reduce, stats, event=True)
            values = stats.tolist()  # the step's one host sync
            sync_wait = clock.blocked_s() - waited
        else:
            self.held = None
            self._window_open = False
            values, update_s, sync_wait = self._update(keys, local_grad, stats, lr, semi)
        ret_g, rank_g, refreshed, stale_g = values[:4]
        busy_all = values[4 : 4 + W]  # every rank's busy seconds (rounded to the stats' dtype)
        busy = busy_all[ctx.rank]
        balance = measured_balance(busy_all)
        collective = sum(c.seconds for c in ctx.comms) - comm_before
        t_end = time.perf_counter()
        comm_total, exposed = clock.measure(t_start, t_end)
        step_s = t_end - t_start
        return {
            "loss": ret_g + cfg.loss.ranking_weight * rank_g if self.ranking else ret_g,
            "retrieval_loss": ret_g,
            "ranking_loss": rank_g if self.ranking else None,
            "updated": update,
            "samples": batch.global_seqs,
            "tokens": batch.global_tokens,
            "step_ms": 1e3 * step_s,
            "compute_ms": 1e3 * compute,
            "sparse_update_ms": 1e3 * update_s,
            "exposed_comm_ms": 1e3 * exposed,
            "comm_ms": 1e3 * comm_total,
            "collective_ms": 1e3 * collective,
            "busy_ms": 1e3 * busy,
            "busy_cpu_ms": 1e3 * busy_cpu,
            **balance,
            "sync_wait_ms": 1e3 * sync_wait,
            "microbatches": len(batch.micro),
            "unique_keys_per_microbatch": sum(batch.mb_unique_keys) / max(1, len(batch.mb_unique_keys)),
            "refreshed_rows": int(refreshed),
            "stale_rows": int(stale_g),
            "staleness": 1 if semi else 0,
            # the cost model's (a·L + b·L² per rank), not measured: see the docstring
            "imbalance": imbalance(batch.rank_costs),
            "imbalance_count_split": imbalance(batch.count_costs),
            "wait_ratio": wait_ratio(batch.rank_costs),
        }

    def _update(self, keys: torch.Tensor, local_grad: torch.Tensor, stats: torch.Tensor, lr: float, semi: bool
                ) -> tuple[list[float], float, float]:
        """The update at the end of a window: dense all-reduce (async, with the step's stats riding along)
        overlapping the sparse replica sum and update, then the dense step. Returns the all-reduced stats,
        the sparse-update seconds (the replica sum's collectives excepted: they are communication) and the
        seconds the main thread was blocked in the all-reduce's wait."""
        cfg, ctx, table, clock = self.cfg, self.ctx, self.table, self.clock
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        table.optimizer.lr = self.sparse_base_lr * lr / cfg.optim.lr  # the same schedule as the dense part
        if ctx.world.live:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.dense_params]
            flat = torch.cat([g.reshape(-1) for g in grads] + [stats.to(grads[0].device if grads else stats.device)])
            launched = time.perf_counter()
            work = ctx.world.all_reduce(flat, async_op=True)
        else:
            grads, flat, work = [], stats, None
        if semi and self.pending is not None:
            clock.wait(self._wait_retrieved, self.pending)
        clip = cfg.optim.grad_clip
        t0 = time.perf_counter()
        if ctx.replica.live:  # the replica sum is a collective the main thread runs itself
            keys, sparse_grad = clock.wait(table.reduce_replicas, keys, local_grad, ctx.replica, event=True)
        else:
            keys, sparse_grad = table.reduce_replicas(keys, local_grad, ctx.replica)
        reduce_s = time.perf_counter() - t0 if ctx.replica.live else 0.0
        if not clip:
            self.active = table.update(keys, sparse_grad)
        update = time.perf_counter() - t0 - reduce_s
        wait_s = 0.0
        if work is not None:
            t0 = time.perf_counter()
            clock.wait(work.wait)
            wait_s = time.perf_counter() - t0
            clock.event(launched, t0 + wait_s)  # the async all-reduce: from its launch until its wait returns
        at = 0
        for p, g in zip(self.dense_params if grads else [], grads, strict=True):
            k = g.numel()
            if p.grad is not None:  # a parameter no loss reached keeps no gradient (AdamW skips it)
                p.grad.copy_(flat[at : at + k].view_as(g))
            at += k
        if clip:
            t0 = time.perf_counter()
            self.active = table.update(keys, self._clip(sparse_grad, clip))
            update += time.perf_counter() - t0
        self.optimizer.step()
        return flat[at:].tolist(), update, wait_s  # the step's one host sync

    def _clip(self, sparse_grad: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Scales dense and sparse gradients together to a global norm of at most ``max_norm`` (what
        ``clip_grad_norm_`` over every parameter, the item table included, does in one process)."""
        dense = [p.grad for p in self.dense_params if p.grad is not None]
        sq_dense = torch.stack([g.pow(2).sum() for g in dense]).sum() if dense else torch.zeros(())
        # every replica group holds the whole table's gradient: sum over one sparse group only
        sq_sparse = sparse_grad.pow(2).sum().reshape(1).to(self.comm_device)
        if self.ctx.sparse_fwd.live:
            self.clock.wait(self.ctx.sparse_fwd.all_reduce, sq_sparse, event=True)
        total = (sq_dense.to(self.comm_device) + sq_sparse[0]).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in dense:
            g.mul_(coef.to(g.device))
        return sparse_grad * coef.to(sparse_grad.device)

    @staticmethod
    def _wait_retrieved(pending: _Pending) -> None:
        """Semi-async: the next batch's rows must be read before this update writes them."""
        while not pending.retrieved.wait(0.05):
            if pending.future.done():
                pending.future.result()  # raises what stopped the prefetch
                return

    def drain(self) -> None:
        """Finishes an in-flight prefetch (its result is dropped: the next step looks up afresh)."""
        if self.pending is not None:
            self.pending.future.result()
            self.offload.discard(self.pending.parked)  # semi-async rows of the dropped batch
            self.pending = None

    def close(self) -> None:
        self.comm_pool.shutdown(wait=False, cancel_futures=True)
        self.pre_pool.shutdown(wait=False, cancel_futures=True)
