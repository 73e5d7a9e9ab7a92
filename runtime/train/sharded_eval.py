"""Evaluation and export on the sharded item table: no rank ever holds more of the table than its own shard
(plus the rows a batch's users look up), whatever the world size (docs/architecture.md §4).

Evaluation (:func:`sharded_eval_ranks`) gives the same ranks as :func:`grstack.runtime.eval.eval_ranks` on
the whole table, each rank for its own users. The members of a sparse group (whose shards cover the table;
other groups hold replicas and evaluate their own users alike) run the same number of rounds; in a round
each member takes its next batch of users (possibly none), looks up their input rows through the table's
lookup protocol, encodes them and gathers every member's query vectors, targets and histories. Each member
then scores all of them against its own normalised rows (``score_items``: each score is the same dot
product as in one full matmul), excludes item 0 and each user's earlier items among its rows (the target
keeps its score, as in ``exclude_history``), and counts per query the rows scoring ``>=`` the target. The
target's score comes from the member that owns the target row (a sum all-reduce, zeros elsewhere), so ties
compare exactly as in one matmul; the counts are sum all-reduced and each member keeps its users' ranks
(count - 1: the target itself).

The ranking head (:func:`sharded_rank_logits`) is evaluated on candidate sets that are a function of the
user alone (``grstack.runtime.eval.rank_head_logits``); each rank scores its own users' sets, looking up the
history and candidate rows through the same protocol, in as many rounds as its sparse group's busiest member.

Export (:func:`export_sharded`) writes the artefact's item rows as one part per shard (the members of the
first sparse group each write theirs), then rank 0 writes ``model.pt`` naming them
(``grstack.runtime.model``'s parts form). With sparse groups of one rank every rank holds the whole table
already, and rank 0 writes the one-file form.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from grstack.runtime.data import LeaveOneOut, SequenceDataset
from grstack.runtime.embedding import ShardedEmbedding
from grstack.runtime.eval import last_token_outputs, rank_head_logits, score_items
from grstack.runtime.model import export_parts, export_state, write_item_part
from grstack.runtime.train.context import DistContext
from grstack.runtime.training_config import Config


def _concat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_zeros((0, *like.shape[1:]))


@torch.no_grad()
def sharded_eval_ranks(model: nn.Module, table: ShardedEmbedding, ctx: DistContext, split: LeaveOneOut,
                       which: str, rows: np.ndarray, *, max_len: int, batch_size: int, device: torch.device,
                       tick: Callable[[], None] | None = None, weight: torch.Tensor | None = None) -> np.ndarray:
    """0-based rank of each target among all items for this rank's users ``rows`` (counts may differ
    between ranks): a collective of this rank's sparse group. ``model`` is the dense model (item rows passed
    in); ``weight``: the shard's rows to evaluate instead of ``table.weight`` (a kept best shard)."""
    comm, plan = ctx.sparse_fwd, table.plan
    G, s = plan.group_size, table.shard_index
    w = table.weight if weight is None else weight
    was_training = model.training
    model.eval()
    items = model.item_vectors(rows=w.to(device))  # [own rows, d], normalised row by row as the full table is
    d = items.shape[1]
    # the table's rows past the items hold side-feature values (model/side_features.py): never ranked
    global_ids = plan.global_ids(s, torch.arange(w.shape[0]))
    beyond = torch.nonzero(global_ids > model.num_items).squeeze(1)
    not_items = beyond.to(device) if beyond.numel() else None
    rounds = max(comm.meta.all_gather_sizes(-(-len(rows) // batch_size)))
    out = []
    for r in range(rounds):
        chunk = rows[r * batch_size : (r + 1) * batch_size]
        batch, targets = split.eval_batch(which, chunk, max_len)
        hist, hoff = split.full_history(which, chunk)
        # every member takes part, with or without users; a token reads its item row and its feature rows, a
        # sequence its user context's
        looked = table.lookup(model.lookup_keys(batch), comm, w)
        if len(chunk):
            item_rows, context_rows = model.looked_rows(batch, looked.to(device))
            batch = batch.to(device)
            enc = model.encode(batch, item_rows=item_rows,
                               **({"context_rows": context_rows} if context_rows is not None else {}))
            q = model.query_vectors(last_token_outputs(enc, batch.offsets))
        else:
            q = items.new_zeros((0, d))
        info = torch.stack([targets.long(), torch.from_numpy(np.diff(hoff)).long()], dim=1)  # [B, 2]: target, history length
        qs = comm.all_gather_v(q)  # query vectors: device data, on the device group
        # targets, history lengths and histories are host data the host indexes with: on the gloo twin
        infos = comm.meta.all_gather_v(info.cpu())
        hists = comm.meta.all_gather_v(torch.from_numpy(hist).long())
        sizes = [x.shape[0] for x in infos]
        mine = sum(sizes[: comm.index])
        Q = _concat(qs, q).to(device)
        info_all = _concat(infos, info)
        T, lengths = info_all[:, 0], info_all[:, 1]
        H = _concat(hists, torch.zeros(0, dtype=torch.int64))
        scores = score_items(Q, items)  # [M, own rows]
        M = scores.shape[0]
        if s == 0:
            scores[:, 0] = -torch.inf  # item 0 (padding) is local row 0 of shard 0
        if not_items is not None:
            scores[:, not_items] = -torch.inf  # side-feature rows are not items
        owned = torch.nonzero(torch.eq(T % G, s)).squeeze(1)
        owned_dev = owned.to(device)
        local_t = (T[owned] // G).to(device)
        keep = scores[owned_dev, local_t].clone()
        row_of = torch.repeat_interleave(torch.arange(M), lengths)
        here = torch.eq(H % G, s)
        scores[row_of[here].to(device), (H[here] // G).to(device)] = -torch.inf
        scores[owned_dev, local_t] = keep
        target_scores = torch.zeros(M, dtype=scores.dtype, device=device)  # device == comm.device
        target_scores[owned_dev] = keep
        comm.all_reduce(target_scores)  # one owner per target, zeros elsewhere: the owner's score exactly
        ahead = (scores >= target_scores[:, None]).sum(dim=1)
        comm.all_reduce(ahead)
        out.append((ahead[mine : mine + len(chunk)] - 1).cpu().numpy())
        if tick is not None:
            tick()
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def sharded_rank_logits(model: nn.Module, table: ShardedEmbedding, ctx: DistContext, split: LeaveOneOut,
                        which: str, rows: np.ndarray, *, max_len: int, batch_size: int, device: torch.device,
                        num_candidates: int, seed: int, num_items: int, tick: Callable[[], None] | None = None,
                        weight: torch.Tensor | None = None, ranking_on: str = "uniform"
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Labels and ranking-head logits [B, M, T] of this rank's users ``rows``: a collective of this rank's
    sparse group (item rows through the table's lookup protocol; ``weight`` as in :func:`sharded_eval_ranks`;
    ``ranking_on`` as in :func:`rank_head_logits`)."""
    comm = ctx.sparse_fwd
    w = table.weight if weight is None else weight
    rounds = max(int(x) for x in comm.meta.all_gather_sizes(-(-len(rows) // batch_size)))
    return rank_head_logits(model, split, which, rows, max_len=max_len, batch_size=batch_size, device=device,
                            num_candidates=num_candidates, seed=seed, num_items=num_items,
                            lookup=lambda ids: table.lookup(ids, comm, w),
                            rounds=rounds, tick=tick, ranking_on=ranking_on)


def export_sharded(model: nn.Module, shard: torch.Tensor, table: ShardedEmbedding, ctx: DistContext,
                   cfg: Config, ds: SequenceDataset, path: Path, step: int) -> None:
    """Writes the artefact ``path`` from the dense ``model`` and every rank's ``shard`` (laid out as
    ``table``'s), without gathering the table: a collective of the world."""
    plan = table.plan
    G = plan.group_size
    dense = model.state_dict()
    if G == 1:  # every rank's shard is the whole table
        if ctx.rank == 0:
            export_state({"item_emb.weight": shard, **dense}, cfg, ds, path)
        return
    tag = ctx.agree(lambda: f"step-{step:09d}-{secrets.token_hex(4)}")
    digest: tuple[int, str] | None = None
    if plan.group_of(ctx.rank) == 0:  # one sparse group's shards cover the table
        digest = (table.shard_index, write_item_part(path, tag, table.shard_index, G, shard))
    written = ctx.world.all_gather_object(digest)  # every part is on disk
    if ctx.rank == 0:
        digests = dict(d for d in written if d is not None)
        export_parts(dense, cfg, ds, path, tag, G, plan.num_rows, [digests[k] for k in range(G)])
