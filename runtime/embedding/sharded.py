"""Row-sharded item embeddings: deduplicated All2All lookup, All2All gradients, sparse updates.

The protocol, per batch (docs/architecture.md §4.3-4.4):

1. ``make_unit`` dedupes the ids of one lookup unit (a micro-batch, or the batch's shared negatives). Keys
   needed at full precision come first, negative-only keys (sent in FP16 when enabled) after them.
2. ``route`` buckets every unit's keys by owner and sends them with one All2All of counts and one of keys;
   the owner records what each source asked for and the union of its requested rows (the batch buffer).
3. ``retrieve`` reads the buffer rows from the store (the owner's shard): the prefetch buffer.
4. ``refresh`` (dual-buffer sync) overwrites buffer rows that the previous step's update changed with the
   updated values, so a lookup prefetched before that update equals one made after it, bit for bit.
5. ``send_rows`` returns a unit's rows to the requester (All2All); ``send_grads`` sends the requester's
   gradient for them back to the owner, which accumulates it in the batch buffer (fixed order).
6. ``apply`` sums the gradient over replica groups (hierarchical parallelism) and runs the sparse
   optimizer on exactly the touched rows; it returns them: the Active rows the next refresh reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from grstack.runtime.embedding.comm import Comm
from grstack.runtime.embedding.optim import SparseOptimizer
from grstack.runtime.embedding.plan import ShardingPlan


def _dev(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host routing metadata (indices) on ``device``: an asynchronous copy, never a host-device sync."""
    return t if t.device == device else t.to(device, non_blocking=True)


@dataclass
class LookupUnit:
    """The deduplicated keys of one lookup, and where they travel."""

    keys: torch.Tensor  # [U] global ids: full-precision keys, then half-precision-only keys
    n_full: int
    has_half: bool = False  # built with a negative segment (the same on every rank: decided by config)
    # requester side (filled by route)
    order: torch.Tensor | None = None  # keys[order] are grouped by owner, full before half within an owner
    send_full: list[int] = field(default_factory=list)
    send_half: list[int] = field(default_factory=list)
    # owner side (filled by route)
    recv_full: list[int] = field(default_factory=list)
    recv_half: list[int] = field(default_factory=list)
    recv_is_half: torch.Tensor | None = None  # [sum received] per source: full..., half...
    pos: torch.Tensor | None = None  # [sum received] index of each requested row in the batch buffer

    @property
    def num_keys(self) -> int:
        return self.keys.numel()


def make_unit(full_ids: torch.Tensor, half_ids: torch.Tensor | None = None
              ) -> tuple[LookupUnit, torch.Tensor, torch.Tensor | None]:
    """Dedupes ids into a unit; returns it with the index of every input id into ``unit.keys``.

    A negative id that also appears among ``full_ids`` uses the full-precision row.
    """
    uf, inv_full = torch.unique(full_ids, return_inverse=True)
    if half_ids is None:
        return LookupUnit(keys=uf, n_full=uf.numel()), inv_full, None
    uh, inv_h = torch.unique(half_ids, return_inverse=True)
    in_full = torch.isin(uh, uf)
    half_only = uh[~in_full]
    where = torch.empty_like(uh)
    where[in_full] = torch.searchsorted(uf, uh[in_full])
    where[~in_full] = uf.numel() + torch.arange(half_only.numel())
    unit = LookupUnit(keys=torch.cat([uf, half_only]), n_full=uf.numel(), has_half=True)
    return unit, inv_full, where[inv_h]


@dataclass
class RoutedBatch:
    """One batch's lookups as seen by this rank, as requester (units) and as owner (the batch buffer)."""

    units: list[LookupUnit]
    keys: torch.Tensor  # sorted unique local rows this rank serves in the batch (its buffer keys)
    rows: torch.Tensor | None = None  # [len(keys), d] the prefetch buffer (after retrieve)
    grad: torch.Tensor | None = None  # [len(keys), d] accumulated gradient
    refreshed: int = 0  # rows overwritten by the dual-buffer sync
    stale: int = 0  # rows read before the previous update changed them (semi-async)


@dataclass
class ActiveRows:
    """Rows the last update wrote (sorted local ids) and their new values."""

    keys: torch.Tensor
    rows: torch.Tensor


class ShardedEmbedding:
    """One rank's shard of a row-sharded table, with its sparse optimizer."""

    def __init__(self, plan: ShardingPlan, rank: int, shard: torch.Tensor, optimizer: SparseOptimizer,
                 half_dtype: torch.dtype = torch.float16) -> None:
        self.plan, self.rank = plan, rank
        self.shard_index = plan.shard_of(rank)
        if shard.shape != (plan.shard_rows(self.shard_index), plan.dim):
            raise ValueError(f"shard shape {tuple(shard.shape)} does not match the plan")
        self.weight = shard
        self.optimizer = optimizer
        self.half_dtype = half_dtype
        self._all_rows: torch.Tensor | None = None
        # the most item-table rows this rank has held in one tensor: its shard, or a gathered table
        # (``full_table``, an old checkpoint's whole best table); lookups' per-batch rows are not counted
        self.rows_held_max = int(shard.shape[0])

    def note_rows(self, rows: int) -> None:
        """Records that this rank held ``rows`` rows of the item table in one tensor."""
        self.rows_held_max = max(self.rows_held_max, int(rows))

    # -- routing (stage 3) ------------------------------------------------------------------------------
    def route(self, units: list[LookupUnit], comm: Comm) -> RoutedBatch:
        G, n_units = self.plan.group_size, len(units)
        counts = torch.zeros(G, n_units, 2, dtype=torch.int64)
        per_dest: list[list[torch.Tensor]] = [[] for _ in range(G)]
        for u, unit in enumerate(units):
            owner = self.plan.owner(unit.keys)
            is_half = torch.arange(unit.num_keys) >= unit.n_full
            unit.order = torch.argsort(owner * 2 + is_half.long(), stable=True)
            sorted_owner = owner[unit.order]
            full = torch.bincount(owner[~is_half], minlength=G)
            half = torch.bincount(owner[is_half], minlength=G)
            counts[:, u, 0], counts[:, u, 1] = full, half
            unit.send_full, unit.send_half = full.tolist(), half.tolist()
            local = self.plan.local_row(unit.keys[unit.order])
            bounds = torch.searchsorted(sorted_owner, torch.arange(G + 1))
            for d in range(G):
                per_dest[d].append(local[bounds[d] : bounds[d + 1]])
        meta = comm.meta  # keys and counts are host data: they travel on the group's gloo twin
        recv_counts = meta.exchange(counts)  # [G sources, n_units, 2]
        send = torch.cat([t for d in range(G) for t in per_dest[d]]) if n_units else torch.zeros(0, dtype=torch.int64)
        send_split = counts.sum(dim=(1, 2)).tolist()
        recv_split = recv_counts.sum(dim=(1, 2)).tolist()
        received = meta.all_to_all(send, send_split, recv_split)
        # received: per source s, per unit u: full keys then half keys
        pieces: list[list[torch.Tensor]] = [[] for _ in range(n_units)]
        halves: list[list[torch.Tensor]] = [[] for _ in range(n_units)]
        at = 0
        for s in range(G):
            for u in range(n_units):
                nf, nh = int(recv_counts[s, u, 0]), int(recv_counts[s, u, 1])
                pieces[u].append(received[at : at + nf + nh])
                halves[u].append(torch.arange(nf + nh) >= nf)
                at += nf + nh
        for u, unit in enumerate(units):
            unit.recv_full = recv_counts[:, u, 0].tolist()
            unit.recv_half = recv_counts[:, u, 1].tolist()
            unit.recv_is_half = torch.cat(halves[u]) if halves[u] else torch.zeros(0, dtype=torch.bool)
        requested = [torch.cat(p) if p else torch.zeros(0, dtype=torch.int64) for p in pieces]
        keys = torch.unique(torch.cat(requested)) if requested else torch.zeros(0, dtype=torch.int64)
        for unit, req in zip(units, requested, strict=True):
            unit.pos = torch.searchsorted(keys, req)
        return RoutedBatch(units=units, keys=keys)

    # -- retrieval (stage 4) and the dual-buffer sync ------------------------------------------------------
    def retrieve(self, rb: RoutedBatch) -> None:
        rb.rows = self.weight.index_select(0, _dev(rb.keys, self.weight.device))
        rb.grad = torch.zeros_like(rb.rows)

    def overlap(self, rb: RoutedBatch, active: ActiveRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer positions whose rows the last update changed, and their index in ``active``."""
        mask = torch.isin(rb.keys, active.keys)
        where = torch.nonzero(mask).squeeze(1)
        return where, torch.searchsorted(active.keys, rb.keys[where])

    def refresh(self, rb: RoutedBatch, active: ActiveRows | None,
                overlap: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """Dual-buffer sync: prefetched rows in keys(t-1) ∩ keys(t) take the just-updated values. ``overlap``:
        ``overlap(rb, active)`` when the caller computed it already (on the host, in another thread)."""
        if active is None or rb.rows is None:
            return 0
        where, idx = overlap if overlap is not None else self.overlap(rb, active)
        dev = rb.rows.device
        rb.rows.index_copy_(0, _dev(where, dev), active.rows.index_select(0, _dev(idx, active.rows.device)).to(dev))
        rb.refreshed = where.numel()
        return rb.refreshed

    # -- rows to requesters, gradients to owners (stage 5) -------------------------------------------------
    def send_rows(self, rb: RoutedBatch, unit: LookupUnit, comm: Comm, fp16: bool) -> torch.Tensor:
        """All2All of one unit's rows back to the requesters; returns this rank's [U, d] rows (fp32).

        With ``fp16`` and a unit that has a negative segment, that segment travels as FP16 in a second
        All2All; otherwise every row travels in one FP32 All2All.
        """
        assert rb.rows is not None and unit.pos is not None and unit.recv_is_half is not None
        assert unit.order is not None
        dev = rb.rows.device
        out_rows = rb.rows.index_select(0, _dev(unit.pos, dev))
        if not (fp16 and unit.has_half):
            send = [f + h for f, h in zip(unit.recv_full, unit.recv_half, strict=True)]
            recv = [f + h for f, h in zip(unit.send_full, unit.send_half, strict=True)]
            got = comm.all_to_all(out_rows, send, recv)
            if self.plan.group_size == 1:  # one owner: the keys are already in owner order
                return got
            rows = got.new_empty((unit.num_keys, self.plan.dim))
            return rows.index_copy_(0, _dev(unit.order, got.device), got)
        # positions are split on the host (a boolean mask on the device would cost a sync)
        half_at = torch.nonzero(unit.recv_is_half).squeeze(1)
        full_at = torch.nonzero(~unit.recv_is_half).squeeze(1)
        full = comm.all_to_all(out_rows.index_select(0, _dev(full_at, dev)), unit.recv_full, unit.send_full)
        half_src = out_rows.index_select(0, _dev(half_at, dev))
        if fp16:
            half_src = half_src.to(self.half_dtype)
        half = comm.all_to_all(half_src, unit.recv_half, unit.send_half)
        rows = full.new_empty((unit.num_keys, self.plan.dim))
        is_half = unit.order >= unit.n_full
        rows.index_copy_(0, _dev(unit.order[~is_half], full.device), full)
        rows.index_copy_(0, _dev(unit.order[is_half], full.device), half.to(full.dtype))
        return rows

    def send_grads(self, rb: RoutedBatch, unit: LookupUnit, grad: torch.Tensor, comm: Comm) -> None:
        """All2All of the requester's [U, d] gradient to the owners, accumulated into the batch buffer."""
        assert rb.grad is not None and unit.order is not None and unit.pos is not None
        send = [f + h for f, h in zip(unit.send_full, unit.send_half, strict=True)]
        recv = [f + h for f, h in zip(unit.recv_full, unit.recv_half, strict=True)]
        ordered = grad if self.plan.group_size == 1 else grad.index_select(0, _dev(unit.order, grad.device))
        got = comm.all_to_all(ordered, send, recv)
        rb.grad.index_add_(0, _dev(unit.pos, rb.grad.device), got.to(rb.grad.device))

    # -- the update ------------------------------------------------------------------------------------------
    def reduce_replicas(self, keys: torch.Tensor, grad: torch.Tensor, replicas: Comm
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums gradients of the same shard over sparse groups: the union of the rows any replica touched, then
        one all-reduce of every replica's rows scattered into it (about 2·|union|·d values per replica whatever
        the number of replicas; every replica receives the same sum, bit for bit). The union is host data, on
        the gloo twin: after one all-reduce of the largest key count, either the keys are all-gathered (padded
        to that count) or, when R replicas' keys would outweigh it, a presence mask of the shard's rows is
        max-reduced (``union_by_mask``): its bytes do not grow with the number of replicas."""
        if not replicas.live:
            return keys, grad
        meta = replicas.meta
        count = torch.tensor([keys.numel()], dtype=torch.int64)
        meta.all_reduce(count, op=dist.ReduceOp.MAX)
        width, rows = int(count), self.weight.shape[0]
        if width == 0:  # no replica touched this shard (every replica sees the same 0)
            return keys, grad
        host = keys.cpu()
        if union_by_mask(replicas.size, width, rows):
            mask = torch.zeros(rows, dtype=torch.uint8)
            mask[host] = 1
            meta.all_reduce(mask, op=dist.ReduceOp.MAX)
            union = torch.nonzero(mask).squeeze(1)
        else:
            padded = torch.full((width,), -1, dtype=torch.int64)
            padded[: host.numel()] = host
            union = torch.unique(torch.cat(meta.all_gather(padded)))
            union = union[union >= 0]
        total = grad.new_zeros((union.numel(), grad.shape[1]), device=replicas.device)
        total.index_add_(0, _dev(torch.searchsorted(union, host), total.device), grad.to(total.device))
        replicas.all_reduce(total)
        return union, total

    def reduce(self, rb: RoutedBatch, replicas: Comm) -> tuple[torch.Tensor, torch.Tensor]:
        """This batch's summed gradient of this shard's rows (sorted local ids, [n, d]), over replicas."""
        assert rb.grad is not None
        return self.reduce_replicas(rb.keys, rb.grad, replicas)

    def update(self, keys: torch.Tensor, grad: torch.Tensor) -> ActiveRows:
        """Runs the shard optimizer on host ``keys`` (sorted local rows) and their gradient; returns the rows
        it changed, keys on the host (the Active rows the next refresh reads)."""
        _, rows = self.optimizer.step(_dev(keys, self.weight.device), grad.to(self.weight.device))
        if self.optimizer.moves_all_rows:
            if self._all_rows is None:
                self._all_rows = torch.arange(self.weight.shape[0])
            return ActiveRows(keys=self._all_rows, rows=rows)
        return ActiveRows(keys=keys, rows=rows)

    def apply(self, rb: RoutedBatch, replicas: Comm) -> ActiveRows:
        return self.update(*self.reduce(rb, replicas))

    # -- read-only lookup (sharded evaluation) --------------------------------------------------------------
    def lookup(self, ids: torch.Tensor, comm: Comm, weight: torch.Tensor | None = None) -> torch.Tensor:
        """[len(ids), d] rows of global ids ``ids`` (host int64) through the lookup protocol (dedupe, route,
        retrieve, All2All back): a collective of the sparse group ``comm`` (every member calls it, with ids of
        its own, possibly none). ``weight``: the rows to serve instead of the shard (a kept copy of it, laid
        out alike). Reads only; rows on ``comm``'s device."""
        unit, inv, _ = make_unit(ids)
        rb = self.route([unit], comm)
        w = self.weight if weight is None else weight
        rb.rows = w.index_select(0, _dev(rb.keys, w.device))
        rows = self.send_rows(rb, unit, comm, fp16=False)
        return rows.index_select(0, _dev(inv, rows.device))

    # -- whole-table helpers (tests and benchmarks: training never gathers the table) ----------------------
    def full_table(self, group: Comm) -> torch.Tensor:
        """Every row of the table. ``group`` lists the ranks of one sparse group first (the world, or this
        rank's sparse group): member i of it holds shard i. Counted in ``rows_held_max``."""
        self.note_rows(self.plan.num_rows)
        shards = group.all_gather_v(self.weight)
        G = self.plan.group_size
        table = self.weight.new_empty((self.plan.num_rows, self.plan.dim))
        for s, shard in enumerate(shards[:G]):
            table[s::G] = shard
        return table


def union_by_mask(replicas: int, max_keys: int, shard_rows: int) -> bool:
    """Whether the replicas agree on their union of touched rows by a presence mask (1 byte per shard row,
    max-reduced) rather than by gathering every replica's keys (8 bytes per key per replica): whichever moves
    fewer bytes. Every replica decides alike, from values they share."""
    return shard_rows <= 8 * replicas * max_keys


def merge_rows(keys_a: torch.Tensor, grad_a: torch.Tensor, keys_b: torch.Tensor, grad_b: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of two sparse gradients given as (sorted unique host keys, [n, d] rows): gradient
    accumulation over the batches of a window. Deterministic (fixed order: a, then b)."""
    union = torch.unique(torch.cat([keys_a, keys_b]))
    total = grad_a.new_zeros((union.numel(), grad_a.shape[1]))
    total.index_add_(0, _dev(torch.searchsorted(union, keys_a), total.device), grad_a)
    total.index_add_(0, _dev(torch.searchsorted(union, keys_b), total.device), grad_b.to(total.device))
    return union, total
