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
* Semi-asynchronous (``semi_async``): t+1's rows are read before t's update (at most one step stale,
  counted in ``stale_rows``) and sent to their requesters while t computes; nothing is refreshed. The rows
  wait in ``HostOffload`` (host memory; negatives in FP16 with ``negatives.fp16``). A resumed semi-async run
  reads its first batch fresh, so unlike the other modes it does not repeat the interrupted run bit for bit.

Threads and lanes (docs/training.md §6). Every collective on a device communicator is issued by the one
``grstack-comm`` thread (``issue_queue``), in the order the main thread (or, for the dense buckets, its
backward's hooks) submits it: the program order, the same on every rank. The prefetch thread does host
work only: routing on the gloo ``sparse-pre`` group, the retrieve, and the refresh plan. Device work runs on
three lanes (``grstack.runtime.streams``): compute (the main thread), comm (the issuing thread's
collectives) and copy (the prefetch's retrieve); a tensor that crosses lanes is handed over with a marker
the receiving lane waits for (and ``keep``-ed there). On CPU the lanes are no-ops and the Futures order
everything.
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

from grstack.runtime.device import host_sync_counter, set_current_device
from grstack.runtime.embedding import ActiveRows, Comm, RoutedBatch, ShardedEmbedding, fused_adamw, merge_rows
from grstack.runtime.streams import Marker, StreamSet
from grstack.runtime.train.balance import imbalance, measured_balance, wait_ratio
from grstack.runtime.train.batching import MicroBatch, PreparedBatch
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.dense_reducer import BucketedAllReduce
from grstack.runtime.train.issue_queue import CollectiveIssuer
from grstack.runtime.train.negatives import GroupLayout, HostOffload, sampled_softmax_sum
from grstack.runtime.train.timing import CommClock
from grstack.runtime.training_config import Config

Overlap = tuple[torch.Tensor, torch.Tensor] | None  # buffer positions the last update changed, their index


@dataclass
class _Pending:
    """A batch prefetched in the prefetch thread (dual-buffer and semi-async)."""

    batch: PreparedBatch
    future: Future  # the lookup: route + retrieve -> RoutedBatch
    retrieved: threading.Event
    rb: RoutedBatch | None = None  # set before ``retrieved``
    marker: Marker | None = None  # copy lane, after the retrieve
    plan: Future | None = None  # the refresh plan (Overlap), after this step's update
    rows: Future | None = None  # semi-async: the rows' All2All on the issuing thread -> comm marker
    parked: list[int] = field(default_factory=list)
    staged: dict[int, Any] = field(default_factory=dict)  # the batch's host data on the device (copy lane)


def _dev(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host batch data on ``device``: an asynchronous copy (a blocking one would wait for the device)."""
    return t if t.device == device else t.to(device, non_blocking=True)


def _tensors(x: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a staged value (a tensor, or a batch dataclass of them)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(v for v in vars(x).values() if isinstance(v, torch.Tensor))


def _take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` for an index of any shape, through index_select: its backward is one index_add
    (advanced indexing's backward is a much slower accumulate-put on CPU)."""
    return rows.index_select(0, index.reshape(-1)).reshape(*index.shape, rows.shape[-1])


class Engine:
    def __init__(self, cfg: Config, ctx: DistContext, model: nn.Module, table: ShardedEmbedding,
                 device: torch.device) -> None:
        self.cfg, self.ctx, self.model, self.table, self.device = cfg, ctx, model, table, device
        self.dense_params = [p for p in model.parameters() if p.requires_grad]
        o = cfg.optim
        # fused where torch has it: the step counts stay on the parameters' device, so the update reads no
        # scalar back (the foreach form reads every parameter's step count on the host)
        self.optimizer = torch.optim.AdamW(self.dense_params, lr=o.lr, betas=(o.beta1, o.beta2),
                                           weight_decay=o.weight_decay,
                                           fused=fused_adamw(device))
        p = cfg.pipeline
        self.prefetching = p.dbp or p.semi_async
        self.ranking = getattr(model, "rank_head", None) is not None and cfg.loss.ranking_weight > 0
        self.exposures = self.ranking and cfg.loss.ranking_on == "exposures"
        self.lanes = StreamSet.for_device(device)
        # one thread issues every device collective; a job without a process group has nothing to issue
        live = any(c.live for c in (ctx.world, ctx.sparse_fwd, ctx.replica))
        self.issuer = CollectiveIssuer(device, self.lanes, threaded=live)
        self.pre_pool = ThreadPoolExecutor(1, thread_name_prefix="grstack-prefetch", initializer=set_current_device,
                                           initargs=(device,))
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
        # the dense gradients live in buckets all-reduced as backward produces them (through the issuer); the
        # last bucket (the input-side layers, filled last) carries the step's stats in a tail and is launched
        # after the sparse gradients' All2All: the sparse update needs those first, and the stats then cost
        # no collective of their own (where the last bucket holds fp32, as the stats are)
        self.stats_size = 4 + ctx.world_size  # losses, refreshed and stale rows, every rank's busy seconds
        self.reducer = BucketedAllReduce(self.dense_params, ctx.world, self._submit_dense, lanes=self.lanes,
                                         bucket_bytes=int(cfg.distributed.bucket_cap_mb * 2**20),
                                         tail=self.stats_size, tail_dtype=torch.float32)
        self._dense_launched: float | None = None
        self._updated: Marker | None = None  # compute lane, after the last sparse update
        self._staged: dict[int, Any] = {}  # id(host tensor) -> its device copy, for the step's batch
        # communication events and the main thread's waits on them (exposed_comm_ms, comm_ms, busy_ms)
        self.clock = CommClock()
        # count the host syncs of every step (``host_syncs`` in its record): device.host_sync_counter
        self.count_host_syncs = False

    def use_lanes(self, lanes: StreamSet) -> None:
        """Runs the engine's device work on ``lanes`` (a traced set, in tests: the order of its records and
        waits); call it between steps."""
        self.lanes = self.issuer.lanes = self.reducer.lanes = lanes

    def _submit_dense(self, fn: Any, *args: Any) -> Future:
        """The dense buckets' launches (from backward's hooks): the async all-reduce's event starts at the
        first one."""
        if self._dense_launched is None:
            self._dense_launched = time.perf_counter()
        return self.issuer.submit(fn, *args)

    # -- stages 3-4 of a batch ------------------------------------------------------------------------------
    def _lookup_now(self, batch: PreparedBatch, updated: Marker | None) -> tuple[RoutedBatch, Marker]:
        """The synchronous lookup, on the issuing thread (comm lane): routing on the sparse group's gloo
        twin, then the retrieve, after the last update wrote the table."""
        rb = self.table.route(batch.units, self.ctx.sparse_fwd)
        self.lanes.comm.wait(updated)
        self.table.retrieve(rb)
        return rb, self.lanes.comm.record()

    def _prefetch(self, pending: _Pending, updated: Marker | None) -> RoutedBatch:
        """The next batch's H2D copy and lookup in the prefetch thread (copy lane): its host data to the device,
        routing on the gloo ``sparse-pre`` group, then the retrieve once the last update (the previous step's)
        has written the table."""
        copy = self.lanes.copy
        with copy:
            pending.staged = self._stage(pending.batch)
            rb = self.table.route(pending.batch.units, self.ctx.sparse_pre)
            copy.wait(updated)
            self.table.retrieve(rb)
            pending.marker = copy.record()
        pending.rb = rb
        pending.retrieved.set()
        return rb

    def _stage(self, batch: PreparedBatch) -> dict[int, Any]:
        """The tensors ``_forward`` moves to the device, copied now from pinned memory on the current lane
        (on CPU: the tensors themselves). Keyed by ``id``: the batch, alive while they are used, holds them."""
        accel = self.device.type != "cpu"

        def moved(t: Any) -> Any:
            return t.pin_memory().to(self.device, non_blocking=True) if accel else t

        out: dict[int, Any] = {}
        for t in (batch.inv_batch_neg, batch.batch_neg_ids):
            if t is not None:
                out[id(t)] = moved(t)
        for mb in batch.micro:
            out[id(mb.full)] = moved(mb.full)
            for t in (mb.inv_input, mb.hist_index, mb.cand_index, mb.inv_target, mb.inv_neg, mb.neg_ids,
                      mb.cand_ids, mb.neg_group, mb.targets, mb.labels, *mb.share):
                if t is not None:
                    out[id(t)] = moved(t)
        return out

    def _at(self, t: torch.Tensor) -> torch.Tensor:
        """Host batch data on the device: its staged copy, else an asynchronous copy now."""
        staged = self._staged.get(id(t))
        return staged if staged is not None else _dev(t, self.device)

    def _start_prefetch(self, batch: PreparedBatch) -> None:
        pending = _Pending(batch=batch, future=Future(), retrieved=threading.Event())
        pending.future = self.pre_pool.submit(self.clock.task, self._prefetch, pending, self._updated)
        self.pending = pending

    def _plan_refresh(self) -> None:
        """After this step's update: which rows of the prefetched buffer it changed (host keys, in the prefetch
        thread, behind the lookup): the refresh (dual-buffer) or the staleness count (semi-async)."""
        pending, active = self.pending, self.active
        if pending is None:
            return

        def plan() -> Overlap:
            assert pending.rb is not None
            return None if active is None else self.table.overlap(pending.rb, active)

        pending.plan = self.pre_pool.submit(plan)

    def _send_parked(self, pending: _Pending) -> tuple[None, Marker]:
        """Semi-async, on the issuing thread: the prefetched batch's rows to their requesters, parked in host
        memory until its step takes them. Waits here (not in the training thread) for the prefetch's routing
        and retrieve; a failed prefetch raises."""
        rb, batch, comm = pending.future.result(), pending.batch, self.lanes.comm
        comm.wait(pending.marker)
        comm.keep(rb.rows)
        for u, unit in enumerate(batch.units):
            rows = self.table.send_rows(rb, unit, self.ctx.sparse_fwd, self.cfg.negatives.fp16)
            pending.parked.append(self.offload.park(rows, half=u == batch.neg_unit))
        return None, comm.record()

    def _issue_semi_rows(self) -> None:
        """Semi-async: the next batch's rows All2All, submitted by the main thread at a fixed point of the step
        (right after this batch's own row fetches, before its gradient All2Alls): the same place in the issue
        order on every rank. The issuing thread waits for the prefetch's retrieve and sends the rows while this
        batch computes (the training thread does not wait for the prefetch: the update does, before it writes
        the table). It may still run when the step returns (``settle``)."""
        pending = self.pending
        if not self.cfg.pipeline.semi_async or pending is None or pending.rows is not None:
            return
        pending.rows = self.issuer.submit(self.clock.task, self._send_parked, pending)

    # -- jobs of the issuing thread (comm lane) ---------------------------------------------------------------
    def _rows_job(self, rb: RoutedBatch, u: int, units: list[Any], ready: Marker | None
                  ) -> tuple[torch.Tensor, Marker]:
        comm = self.lanes.comm
        comm.wait(ready)
        comm.keep(rb.rows)
        rows = self.table.send_rows(rb, units[u], self.ctx.sparse_fwd, self.cfg.negatives.fp16)
        return rows, comm.record()

    def _grads_job(self, rb: RoutedBatch, unit: Any, grad: torch.Tensor, ready: Marker) -> tuple[None, Marker]:
        comm = self.lanes.comm
        comm.wait(ready)
        comm.keep(grad, rb.grad)
        self.table.send_grads(rb, unit, grad, self.ctx.sparse_fwd)
        return None, comm.record()

    def _all_reduce_job(self, group: Comm, t: torch.Tensor, ready: Marker) -> tuple[None, Marker]:
        lane = self.lanes.comm
        lane.wait(ready)
        lane.keep(t)
        group.all_reduce(t)
        return None, lane.record()

    def _launch_job(self, group: Comm, t: torch.Tensor, ready: Marker) -> tuple[Any, None]:
        """An async all-reduce; its ``wait`` orders the waiter's stream after it (gloo: blocks the host)."""
        lane = self.lanes.comm
        lane.wait(ready)
        lane.keep(t)
        return group.all_reduce(t, async_op=True), None

    def _replica_job(self, keys: torch.Tensor, grad: torch.Tensor, ready: Marker
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor], Marker]:
        lane = self.lanes.comm
        lane.wait(ready)
        lane.keep(grad)
        out = self.table.reduce_replicas(keys, grad, self.ctx.replica)
        return out, lane.record()

    def _received(self, fut: Future) -> Any:
        """The main thread waits for an issuing-thread job (a (result, comm marker) pair); the compute lane
        then waits for the marker. Returns the result."""
        result, marker = self.clock.wait(fut.result)
        self.lanes.compute.wait(marker)
        return result

    # -- stage 5 --------------------------------------------------------------------------------------------
    def _forward(self, batch: PreparedBatch, mb: MicroBatch, rows: torch.Tensor,
                 neg_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The micro-batch's loss, and its retrieval and ranking parts (detached, on the device: reading them
        on the host would cost a sync per micro-batch). Dense compute runs under autocast with
        ``train.precision=bf16``; the loss is computed in fp32 from fp32 copies of its inputs."""
        cfg, dev = self.cfg, self.device
        at = self._at
        full = self._staged.get(id(mb.full))
        if full is None:
            full = mb.full.to(dev, non_blocking=True)
        item_rows, context_rows = self.model.looked_rows(full, _take(rows, at(mb.inv_input)))
        hist_at = cand_at = None
        if mb.is_hist is not None:  # positions split on the host (Preparer): a device mask would cost a sync
            assert mb.hist_index is not None and mb.cand_index is not None
            hist_at, cand_at = at(mb.hist_index), at(mb.cand_index)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = self.model.encode(full, item_rows=item_rows,
                                    **({"context_rows": context_rows} if context_rows is not None else {}))
            hist_out = out.index_select(0, hist_at) if hist_at is not None else out
            q = self.model.query_vectors(hist_out)
            # normalised once per looked-up row, then gathered: with a negative set per token the gathered
            # [N, R, d] is ~100x the unique rows, and normalising it (and its backward) dominated the step
            normed = self.model.item_vectors(rows=rows)
            pos = _take(normed, at(mb.inv_target))
            if mb.inv_neg is not None:
                neg = _take(normed, at(mb.inv_neg))
                neg_ids = at(mb.neg_ids)
            else:
                assert neg_rows is not None and batch.inv_batch_neg is not None and batch.batch_neg_ids is not None
                neg = _take(self.model.item_vectors(rows=neg_rows), at(batch.inv_batch_neg))
                neg_ids = at(batch.batch_neg_ids)
            logits = None
            if self.ranking and mb.labels is not None and cand_at is not None:
                cand_out = out.index_select(0, cand_at)
                logits = self.model.rank_logits(cand_out, at(mb.cand_ids).reshape(-1),
                                                cand_rows=item_rows.index_select(0, cand_at))
        share = [at(p) for p in mb.share]
        group_of = layout = None
        if mb.neg_group is not None:
            layout = mb.neg_layout if mb.neg_layout is not None else GroupLayout.of(mb.neg_group)
            group_of = at(mb.neg_group)
        ret = sampled_softmax_sum(q.float(), pos.float(), neg.float(), at(mb.targets), neg_ids,
                                  cfg.loss.temperature, group_of, share, layout)
        ret = ret / batch.global_tokens
        loss = ret
        rank_t = None
        if logits is not None:
            T = mb.labels.shape[-1]
            labels = at(mb.labels).reshape(-1, T)
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

        * ``busy_ms``: this rank's own work from the step's start until it is ready for the update (the
          dense buckets but the last are in flight by then; the last carries the stats, and a step without
          an update sums them with an all-reduce of their own): the
          step's time up to that point minus the time the main thread was blocked on communication in it
          (waiting for the batch's lookup, its rows, its gradient sends; at world size 1, running them
          inline). So it counts forward and backward and the host work of the step (moving rows to the
          device, the dual-buffer refresh, starting the next prefetch, merging the accumulation window's
          sparse gradients). It does not count the waits: a collective (an All2All of rows or gradients)
          returns only when every rank has entered it, so a fast rank waits for a slow one inside those
          waits, and counting them would make every rank's busy time equal to the slowest one's. The sparse
          replica sum and update run while the dense buckets are reduced and are not counted.
        * ``busy_ms_max``, ``wait_ratio_measured``, ``imbalance_measured``: from every rank's busy time of
          this step (``balance.measured_balance``), gathered with the step's stats.
          ``busy_cpu_ms``: the main thread's CPU time over the same span (this rank's only): its work without
          the time the OS gave to other processes (with one intra-op thread, as in ``bench train``). On an
          accelerator both are host times: kernels run asynchronously.
        * ``sync_wait_ms``: the time the main thread was blocked at the synchronisation points (the dense
          buckets' wait and the stats' read).
        * ``comm_ms`` / ``exposed_comm_ms``: the step's communication events inside the step, and the part of
          them during which the main thread was blocked (``timing``); ``collective_ms``: the time spent inside
          collectives (``Comm`` counters, every thread), whatever the main thread did meanwhile.
        * ``imbalance``, ``imbalance_count_split``, ``wait_ratio``: the cost model's figures (per-rank cost
          a·L + b·L² of the split used, and of the equal-count split), not measurements.
        * ``host_syncs`` / ``host_syncs_counter`` (with ``count_host_syncs``): the step's host syncs as
          ``device.host_sync_counter`` counts them, and that counter's name.
        """
        if not self.count_host_syncs:
            return self._step(batch, upcoming, lr, update, grad_scale)
        with host_sync_counter(self.device) as syncs:
            out = self._step(batch, upcoming, lr, update, grad_scale)
        return {**out, "host_syncs": syncs.count, "host_syncs_counter": syncs.counter}

    def _step(self, batch: PreparedBatch, upcoming: PreparedBatch | None, lr: float, update: bool,
              grad_scale: float) -> dict[str, Any]:
        cfg, ctx, table, clock, lanes = self.cfg, self.ctx, self.table, self.clock, self.lanes
        compute_lane = lanes.compute
        clock.start()
        t_start = time.perf_counter()
        cpu_start = time.thread_time()
        comm_before = sum(c.seconds for c in ctx.comms)
        compute = 0.0
        semi = cfg.pipeline.semi_async
        pending = (self.pending if self.pending is not None and self.pending.batch.global_step == batch.global_step
                   else None)
        self.pending = None
        self._staged = {}
        stale = refreshed = 0
        if pending is not None:
            rb = clock.wait(pending.future.result)
            compute_lane.wait(pending.marker)  # the H2D copies and the retrieve, on the copy lane
            compute_lane.keep(rb.rows, rb.grad)
            self._staged = pending.staged
            for t in self._staged.values():
                compute_lane.keep(*_tensors(t))
            assert pending.plan is not None
            overlap = clock.wait(pending.plan.result)
            if semi:
                stale = 0 if overlap is None else overlap[0].numel()
            else:
                refreshed = table.refresh(rb, self.active, overlap)
        else:
            rb = self._received(self.issuer.submit(clock.task, self._lookup_now, batch, self._updated))
            compute_lane.keep(rb.rows, rb.grad)
        ready = compute_lane.record()  # the buffer as the rows' All2Alls read it (after the refresh)
        semi_rows = pending is not None and semi
        if semi_rows:
            assert pending is not None and pending.rows is not None
            self._received(pending.rows)  # the parked rows' device-to-host copies
        if self.prefetching and upcoming is not None:
            self._start_prefetch(upcoming)

        if self._window_open is False:  # the first batch of an accumulation window
            self.reducer.start_window()
            self._dense_launched = None
            self._window_open = True

        def fetch(u: int) -> Future:
            return self.issuer.submit(clock.task, self._rows_job, rb, u, batch.units, ready)

        def rows_of(u: int, fut: Future | None) -> torch.Tensor:
            if semi_rows:
                assert pending is not None
                return self.offload.take(pending.parked[u])
            assert fut is not None
            rows = self._received(fut)
            compute_lane.keep(rows)
            return rows.to(self.device, non_blocking=True)

        def send_grads(unit: Any, leaf: torch.Tensor) -> Future:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            grad = grad.to(self.comm_device)
            return self.issuer.submit(clock.task, self._grads_job, rb, unit, grad, compute_lane.record())

        n = len(batch.micro)
        futures: dict[int, Future] = {}
        if not semi_rows:
            if batch.neg_unit is not None:
                futures[batch.neg_unit] = fetch(batch.neg_unit)
            futures[batch.micro[0].unit] = fetch(batch.micro[0].unit)
        self._issue_semi_rows()  # the next batch's rows travel while this one computes
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
                    assert pending is not None
                    self.offload.prefetch(pending.parked[batch.micro[m + 1].unit])
                else:
                    futures[batch.micro[m + 1].unit] = fetch(batch.micro[m + 1].unit)
            last = update and m + 1 == n
            t0 = time.perf_counter()
            loss, ret_part, rank_part = self._forward(batch, mb, leaf, neg_leaf)
            if last:
                self.reducer.arm()  # this backward's hooks launch the dense buckets as they fill
            (loss * grad_scale if grad_scale != 1.0 else loss).backward()
            if last:
                self.reducer.flush()  # before the gradient All2All: every rank issues buckets, then gradients
            compute += time.perf_counter() - t0
            ret_total = ret_total + ret_part
            if rank_part is not None:
                rank_total = rank_total + rank_part
            grad_futures.append(send_grads(batch.units[mb.unit], leaf))
        if batch.neg_unit is not None:
            assert neg_leaf is not None
            grad_futures.append(send_grads(batch.units[batch.neg_unit], neg_leaf))
        for f in grad_futures:
            self._received(f)
        assert rb.grad is not None
        keys, local_grad = rb.keys, rb.grad
        if self.held is not None:  # earlier batches of this accumulation window
            keys, local_grad = merge_rows(self.held[0], self.held[1], keys, local_grad)
        # ready for the update: this rank's busy seconds go in its own slot of the stats (the sum over ranks
        # then holds every rank's)
        W = ctx.world_size
        busy = time.perf_counter() - t_start - clock.blocked_s()
        busy_cpu = time.thread_time() - cpu_start
        slots = [0.0] * W
        slots[ctx.rank] = busy
        extra = torch.tensor([float(refreshed), float(stale), *slots])  # host values: copied, never read back
        if self.device.type != "cpu":
            extra = extra.pin_memory()
        stats = torch.cat([ret_total.reshape(1), rank_total.reshape(1), _dev(extra, self.device)])
        stats = stats.to(ctx.comm_device)
        summed: tuple[Future, float] | None = None
        if update and self.reducer.tail is not None:
            self.reducer.release(stats)  # the held bucket, the stats in its tail: summed with the gradients
            stats = self.reducer.tail
        else:
            summed = self._sum_stats(stats)
        update_s = sync_wait = 0.0
        if not update:
            self.held = (keys, local_grad)
            self.active = None  # nothing was written: the next prefetched rows need no refresh
            self._plan_refresh()
        else:
            self.held = None
            self._window_open = False
            update_s, sync_wait = self._update(keys, local_grad, lr, semi)
        values, stats_wait = self._read_stats(summed, stats)
        sync_wait += stats_wait
        ret_g, rank_g, refreshed_g, stale_g = values[:4]
        busy_all = values[4 : 4 + W]  # every rank's busy seconds (rounded to the stats' dtype)
        busy = busy_all[ctx.rank]
        balance = measured_balance(busy_all)
        self._staged = {}
        collective = sum(c.seconds for c in ctx.comms) - comm_before
        t_end = time.perf_counter()
        blocked = clock.blocked_s()  # the main thread's waits of this step (measure forgets them)
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
            "blocked_comm_ms": 1e3 * blocked,
            "comm_ms": 1e3 * comm_total,
            "collective_ms": 1e3 * collective,
            "busy_ms": 1e3 * busy,
            "busy_cpu_ms": 1e3 * busy_cpu,
            **balance,
            "sync_wait_ms": 1e3 * sync_wait,
            "microbatches": len(batch.micro),
            "unique_keys_per_microbatch": sum(batch.mb_unique_keys) / max(1, len(batch.mb_unique_keys)),
            "refreshed_rows": int(refreshed_g),
            "stale_rows": int(stale_g),
            "staleness": 1 if semi else 0,
            # the cost model's (a·L + b·L² per rank), not measured: see the docstring
            "imbalance": imbalance(batch.rank_costs),
            "imbalance_count_split": imbalance(batch.count_costs),
            "wait_ratio": wait_ratio(batch.rank_costs),
        }

    def _sum_stats(self, stats: torch.Tensor) -> tuple[Future, float] | None:
        """Launches the step's stats all-reduce over the world (async: it runs during the update); None
        without a process group. Returns its job and the launch time."""
        if not self.ctx.world.live:
            return None
        launched = time.perf_counter()
        return self.issuer.submit(self.clock.task, self._launch_job, self.ctx.world, stats,
                                  self.lanes.compute.record()), launched

    def _read_stats(self, summed: tuple[Future, float] | None, stats: torch.Tensor) -> tuple[list[float], float]:
        """Waits for the stats all-reduce and reads the sums on the host: the step's one host sync. Returns
        the values and the seconds the main thread waited."""
        t0 = time.perf_counter()
        if summed is not None:
            work = self._received(summed[0])
            if work is not None:
                self.clock.wait(work.wait)
            self.clock.event(summed[1], time.perf_counter())  # from its launch until its wait returned
        values = stats.tolist()  # the step's one host sync
        return values, time.perf_counter() - t0

    def _update(self, keys: torch.Tensor, local_grad: torch.Tensor, lr: float, semi: bool
                ) -> tuple[float, float]:
        """The update at the end of a window: the replica sum and the sparse update while the dense buckets
        (launched during the last backward) are reduced, then the dense step. Returns the sparse-update
        seconds (the replica sum's collectives excepted: they are communication) and the seconds the main
        thread was blocked in the buckets' wait."""
        cfg, ctx, table, clock = self.cfg, self.ctx, self.table, self.clock
        compute_lane = self.lanes.compute
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        table.optimizer.lr = self.sparse_base_lr * lr / cfg.optim.lr  # the same schedule as the dense part
        clip = cfg.optim.grad_clip
        if ctx.replica.live:  # on the issuing thread, behind the dense buckets
            keys, sparse_grad = self._received(self.issuer.submit(clock.task, self._replica_job, keys,
                                                                  local_grad, compute_lane.record()))
        else:
            sparse_grad = local_grad
        if semi and self.pending is not None:  # the update writes only after the next batch's rows were read
            clock.wait(self._wait_retrieved, self.pending)
            compute_lane.wait(self.pending.marker)
        t0 = time.perf_counter()
        if not clip:
            self.active = table.update(keys, sparse_grad)
            self._updated = compute_lane.record()
        update = time.perf_counter() - t0
        t0 = time.perf_counter()
        clock.wait(self.reducer.wait)
        wait_s = time.perf_counter() - t0
        if self._dense_launched is not None:  # the buckets: from the first launch until their wait returns
            clock.event(self._dense_launched, t0 + wait_s)
        if clip:
            t0 = time.perf_counter()
            self.active = table.update(keys, self._clip(sparse_grad, clip))
            self._updated = compute_lane.record()
            update += time.perf_counter() - t0
        self.optimizer.step()
        self._plan_refresh()
        return update, wait_s

    def _clip(self, sparse_grad: torch.Tensor, max_norm: float) -> torch.Tensor:
        """Scales dense and sparse gradients together to a global norm of at most ``max_norm`` (what
        ``clip_grad_norm_`` over every parameter, the item table included, does in one process)."""
        dense = [p.grad for p in self.dense_params if p.grad is not None]
        sq_dense = torch.stack([g.pow(2).sum() for g in dense]).sum() if dense else torch.zeros(())
        # every replica group holds the whole table's gradient: sum over one sparse group only
        sq_sparse = sparse_grad.pow(2).sum().reshape(1).to(self.comm_device)
        if self.ctx.sparse_fwd.live:
            self._received(self.issuer.submit(self.clock.task, self._all_reduce_job, self.ctx.sparse_fwd,
                                              sq_sparse, self.lanes.compute.record()))
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

    def settle(self) -> None:
        """Returns once every collective the engine submitted is done. Only semi-async's rows of the next
        batch may still travel after a step returns; call this before issuing device collectives from this
        thread between steps (evaluation, checkpoints), so no two threads use communicators at once."""
        self.issuer.drain()

    def drain(self) -> None:
        """Finishes an in-flight prefetch (its result is dropped: the next step looks up afresh)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            for fut in (pending.future, pending.plan, pending.rows):
                if fut is not None:
                    fut.result()
            self.offload.discard(pending.parked)  # semi-async rows of the dropped batch
        self.issuer.drain()

    def close(self) -> None:
        self.issuer.close()
        self.pre_pool.shutdown(wait=False, cancel_futures=True)
        self.reducer.close()
