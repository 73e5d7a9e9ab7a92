"""The CPU engine behind :func:`grstack.kernels.reference.hstu_attention_reference`.

Same math as the reference docstring, computed per length group of a :class:`JaggedPlan` with a
hand-written backward, arranged for CPU speed:

- everything that depends only on the batch (masks, position distances, log time buckets) is computed once
  per plan and reused by every layer; the position and time tables are folded into one table
  ``W[d, t] = pos_w[d] + time_w[t]`` so each layer's bias is a single int32 ``index_select`` and its gradient
  a single ``index_add_``;
- long groups are cut into query-row chunks that only see keys up to the chunk's last row (the causal upper
  triangle is never computed) and whose [H, G, rows, keys] tiles stay cache-sized;
- queries, keys and values are gathered once (one ``index_select`` each) into a group-major layout where
  every group is a contiguous [H, G, L, d] block, so each chunk is a bmm-ready view (no copies), and the
  input gradients go back with one ``index_select`` each instead of an accumulating ``index_put``.

Forward values are those of the unfused formulation up to fp32 rounding of the matmuls; the backward is the
analytic gradient of the same expression (``silu_backward`` as autograd uses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grstack.kernels.bias import time_buckets
from grstack.kernels.inputs import AttentionInputs
from grstack.kernels.plan import JaggedPlan, cached, tensor_key

# A chunk's [H, G, rows, keys] tile holds about this many elements (cache-sized; ~4 MB in fp32).
CHUNK_ELEMENTS = 1 << 20
# Groups up to this length are one chunk: their upper triangle is small and fewer ops cost less.
SINGLE_CHUNK_LEN = 128


@dataclass(frozen=True)
class _Layout:
    """Group-major slot layout: group g occupies rows ``[start, start + H*G*L)`` of a [rows, d] buffer, as a
    contiguous [H, G, L, d] block (so every chunk is a bmm-ready view with mergeable batch dims)."""

    rows: torch.Tensor  # [sum_g H*G*L] row of the flat [num_tokens * H, d] input per slot (pad -> row 0)
    pad_rows: torch.Tensor  # slots that hold no token (zeroed after the gather)
    token_rows: torch.Tensor  # [num_tokens * H] slot row of each (token, head)
    groups: tuple[tuple[int, int, int], ...]  # (start, G, L)
    heads: int


@dataclass(frozen=True)
class _Chunk:
    group: int
    r0: int  # query rows [r0, r1) of the group's [G, L] block; keys [0, r1)
    r1: int
    scale: torch.Tensor  # [G or 1, rows, r1] allowed / N, in the compute dtype
    index: torch.Tensor | None  # [G or 1, rows, r1] int32 into the flat bias table


def _layout(plan: JaggedPlan, heads: int) -> _Layout:
    def build() -> _Layout:
        parts, groups, start = [], [], 0
        h = torch.arange(heads, device=plan.inverse.device)[:, None, None]
        for g in plan.groups:
            parts.append((g.index[None] * heads + h).reshape(-1))
            groups.append((start, g.index.shape[0], g.max_len))
            start += heads * g.index.numel()
        rows = torch.cat(parts)
        real = plan.num_tokens * heads
        valid = rows < real
        slots = torch.arange(start, device=rows.device)
        # sizes the host knows (real rows, start - real pad slots): no bool-mask indexing, so no host sync
        token_rows = torch.empty(real + 1, dtype=torch.int64, device=rows.device)
        token_rows.scatter_(0, torch.where(valid, rows, real), slots)  # pad slots all land on the dropped row
        pad_rows = torch.argsort(valid.to(torch.int8), stable=True)[:start - real]
        return _Layout(torch.where(valid, rows, 0), pad_rows, token_rows[:real], tuple(groups), heads)

    return cached(plan, ("layout", heads), build)


def _row_chunks(length: int, heads: int, group_size: int) -> list[tuple[int, int]]:
    if length <= SINGLE_CHUNK_LEN:
        return [(0, length)]
    rows = max(64, min(length, CHUNK_ELEMENTS // max(1, heads * group_size * length)))
    rows = -(-rows // 16) * 16
    return [(r0, min(length, r0 + rows)) for r0 in range(0, length, rows)]


def _chunks(plan: JaggedPlan, heads: int, max_seq_len: int, dtype: torch.dtype, num_pos: int | None,
            num_tb: int | None, timestamps: torch.Tensor | None, num_targets: torch.Tensor | None,
            query_timestamps: torch.Tensor | None = None) -> list[_Chunk]:
    """Masks and bias-table indices of every chunk; depends on the batch, not on the layer.
    ``query_timestamps``: each query row's time in the time bucket (None: its own timestamp)."""

    def build() -> list[_Chunk]:
        out = []
        for gi, g in enumerate(plan.groups):
            G, L = g.index.shape
            device = g.index.device
            ar = torch.arange(L, device=device)
            hist = pos = ts = qts = None
            if num_targets is not None:
                hist = (g.lengths - num_targets[g.seq]).clamp(min=0)
                pos = torch.minimum(ar[None, :], hist[:, None])  # [G, L]
            if num_tb is not None:
                ext = torch.cat([timestamps, timestamps.new_zeros(1)])
                ts = ext[g.index]  # [G, L]
                qts = ts
                if query_timestamps is not None:
                    qts = torch.cat([query_timestamps, query_timestamps.new_zeros(1)])[g.index]
            for r0, r1 in _row_chunks(L, heads, G):
                i, j = ar[r0:r1, None], ar[None, :r1]
                allowed = (i >= j)[None]
                if hist is not None:
                    jh = ar[None, None, :r1] < hist[:, None, None]
                    allowed = allowed & (jh | (i == j)[None])
                scale = allowed.to(dtype) / max_seq_len
                index = None
                if num_pos is not None:
                    dist = (pos[:, r0:r1, None] - pos[:, None, :r1]) if pos is not None else (i - j)[None]
                    index = dist.clamp(0, num_pos - 1)
                if num_tb is not None:
                    bucket = time_buckets(qts[:, r0:r1, None] - ts[:, None, :r1], num_tb)
                    index = bucket if index is None else index * (num_tb + 1) + bucket
                if index is not None:
                    index = index.to(torch.int32).contiguous()
                out.append(_Chunk(gi, r0, r1, scale, index))
        return out

    key = ("chunks", heads, max_seq_len, dtype, num_pos, num_tb, tensor_key(timestamps),
           tensor_key(num_targets), tensor_key(query_timestamps))
    keep = [t for t in (timestamps, num_targets, query_timestamps) if t is not None]
    return cached(plan, key, build, keep_alive=keep)


def _gather(x: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """[N, H, d] -> [slots, d] in the group-major layout (pad slots zero)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat.index_select(0, layout.rows).index_fill_(0, layout.pad_rows, 0)


def _scatter(buf: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """[slots, d] -> [N, H, d] (pad slots dropped)."""
    return buf.index_select(0, layout.token_rows).view(-1, layout.heads, buf.shape[-1])


def _group_views(buf: torch.Tensor, layout: _Layout) -> list[torch.Tensor]:
    h, d = layout.heads, buf.shape[-1]
    return [buf[s0:s0 + h * G * L].view(h, G, L, d) for s0, G, L in layout.groups]


class _GroupedHSTU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pos_w, time_w, layout, chunks, has_pos, has_time):
        qs, ks, vs = _gather(q, layout), _gather(k, layout), _gather(v, layout)
        if has_pos and has_time:
            table = (pos_w[:, None] + time_w[None, :]).reshape(-1)
        else:
            table = pos_w if has_pos else time_w if has_time else None
        outs = torch.empty_like(vs)
        qg, kg, vg, og = (_group_views(t, layout) for t in (qs, ks, vs, outs))
        saved = []
        keep = any(ctx.needs_input_grad[:5])
        for ch in chunks:
            qc, kc, vc = qg[ch.group][:, :, ch.r0:ch.r1], kg[ch.group][:, :, :ch.r1], vg[ch.group][:, :, :ch.r1]
            s = torch.matmul(qc, kc.transpose(-1, -2))  # [H, G, rows, r1]
            if table is not None:
                s += table.index_select(0, ch.index.view(-1)).view(ch.index.shape).to(s.dtype)
            a = F.silu(s).mul_(ch.scale)
            og[ch.group][:, :, ch.r0:ch.r1] = torch.matmul(a, vc)
            if keep:
                saved.append((s, a))
        ctx.layout, ctx.chunks, ctx.saved = layout, chunks, saved
        ctx.tensors = (qs, ks, vs)
        ctx.table_shape = (pos_w.numel() if has_pos else None, time_w.numel() if has_time else None)
        ctx.table_dtype = table.dtype if table is not None else None
        return _scatter(outs, layout)

    @staticmethod
    def backward(ctx, dout):
        layout, chunks, saved = ctx.layout, ctx.chunks, ctx.saved
        qs, ks, vs = ctx.tensors
        num_pos, num_time = ctx.table_shape
        need_table = (num_pos is not None and ctx.needs_input_grad[3]) or (
            num_time is not None and ctx.needs_input_grad[4])
        dos = _gather(dout, layout)
        # every slot is written: the last chunk of a group spans all its keys and is done first (assigning),
        # earlier chunks then accumulate into their key prefix
        dqs, dks, dvs = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
        dtable = None
        if need_table:
            size = (num_pos or 1) * (num_time or 1)
            dtable = torch.zeros(size, dtype=ctx.table_dtype, device=qs.device)
        qg, kg, vg, dog, dqg, dkg, dvg = (_group_views(t, layout) for t in (qs, ks, vs, dos, dqs, dks, dvs))
        for ch, (s, a) in zip(reversed(chunks), reversed(saved), strict=True):
            g, r0, r1 = ch.group, ch.r0, ch.r1
            qc, kc, vc, doc = qg[g][:, :, r0:r1], kg[g][:, :, :r1], vg[g][:, :, :r1], dog[g][:, :, r0:r1]
            da = torch.matmul(doc, vc.transpose(-1, -2)).mul_(ch.scale)
            ds = torch.ops.aten.silu_backward(da, s)
            dqg[g][:, :, r0:r1] = torch.matmul(ds, kc)
            if r1 == dkg[g].shape[2]:
                dkg[g][:] = torch.matmul(ds.transpose(-1, -2), qc)
                dvg[g][:] = torch.matmul(a.transpose(-1, -2), doc)
            else:
                dkg[g][:, :, :r1] += torch.matmul(ds.transpose(-1, -2), qc)
                dvg[g][:, :, :r1] += torch.matmul(a.transpose(-1, -2), doc)
            if dtable is not None:
                db = ds.sum(0)
                if ch.index.shape[0] == 1:
                    db = db.sum(0, keepdim=True)
                dtable.index_add_(0, ch.index.view(-1), db.reshape(-1).to(dtable.dtype))
        ctx.saved = None
        dpos = dtime = None
        if dtable is not None:
            if num_pos is not None and num_time is not None:
                dtable = dtable.view(num_pos, num_time)
                dpos, dtime = dtable.sum(1), dtable.sum(0)
            elif num_pos is not None:
                dpos = dtable
            else:
                dtime = dtable
        return (_scatter(dqs, layout), _scatter(dks, layout), _scatter(dvs, layout),
                dpos if ctx.needs_input_grad[3] else None, dtime if ctx.needs_input_grad[4] else None,
                None, None, None, None)


def grouped_hstu_attention(inputs: AttentionInputs, plan: JaggedPlan) -> torch.Tensor:
    """[sum_L, H, d] q, k and [sum_L, H, dv] v -> [sum_L, H, dv] over the plan's length groups
    (``query_timestamps``: the query rows' times in the time bias, None: their own timestamps)."""
    q, k, v, pos_weight, time_weight = inputs.q, inputs.k, inputs.v, inputs.pos_weight, inputs.time_weight
    has_pos = pos_weight is not None
    has_time = inputs.uses_time
    layout = _layout(plan, q.shape[1])
    chunks = _chunks(plan, q.shape[1], inputs.max_seq_len, q.dtype, pos_weight.numel() if has_pos else None,
                     time_weight.numel() - 1 if has_time else None, inputs.timestamps if has_time else None,
                     inputs.num_targets, inputs.query_timestamps if has_time else None)
    return _GroupedHSTU.apply(q, k, v, pos_weight, time_weight if has_time else None, layout, chunks, has_pos,
                              has_time)
