"""Appending ranking candidates to a jagged history batch (the ranking head's input layout), and the labels of
candidates that are logged exposures."""

from __future__ import annotations

import numpy as np
import torch

from grstack.kernels import segment_ids
from grstack.runtime.data.jagged import JaggedBatch


def append_candidates(batch: JaggedBatch, cand_ids: torch.Tensor, cand_ts: torch.Tensor) -> tuple[JaggedBatch,
                                                                                                  torch.Tensor]:
    """Returns the batch with ``M`` candidate tokens after each history and a [sum_L'] history mask.

    cand_ids: [B, M]; cand_ts: [B] (the request time every candidate carries). Item ids, timestamps,
    offsets, the user context and the tokens' own actions are carried over (candidates' actions are -1:
    unknown, they are what the ranking head predicts); ``num_targets`` is set to M for every sequence. Nothing
    is read back from the device (the host lengths grow by M).
    """
    B, M = cand_ids.shape
    lengths = batch.lengths
    device = batch.item_ids.device
    new_offsets = batch.offsets + M * torch.arange(B + 1, device=device)
    total = batch.num_tokens + B * M  # from the shapes: no read of the offsets
    seg = segment_ids(batch.offsets, batch.num_tokens)
    hist_pos = torch.arange(batch.num_tokens, device=device) + M * seg
    cand_pos = (new_offsets[:-1] + lengths)[:, None] + torch.arange(M, device=device)[None, :]
    item_ids = torch.empty(total, dtype=batch.item_ids.dtype, device=device)
    timestamps = torch.empty(total, dtype=batch.timestamps.dtype, device=device)
    item_ids[hist_pos] = batch.item_ids
    timestamps[hist_pos] = batch.timestamps
    item_ids[cand_pos.reshape(-1)] = cand_ids.reshape(-1)
    timestamps[cand_pos.reshape(-1)] = cand_ts[:, None].expand(B, M).reshape(-1)
    is_hist = torch.zeros(total, dtype=torch.bool, device=device)
    is_hist[hist_pos] = True
    input_actions = None
    if batch.input_actions is not None:
        input_actions = torch.full((total,), -1, dtype=batch.input_actions.dtype, device=device)
        input_actions[hist_pos] = batch.input_actions
    out = JaggedBatch(item_ids=item_ids, offsets=new_offsets, timestamps=timestamps,
                      num_targets=torch.full((B,), M, dtype=torch.int64, device=device),
                      user_index=batch.user_index, input_actions=input_actions, context=batch.context,
                      host_lengths=None if batch.host_lengths is None else tuple(n + M for n in batch.host_lengths))
    return out, is_hist


def exposure_labels(actions: np.ndarray | None, num_tasks: int) -> np.ndarray:
    """[B, k, T] labels of blocks of logged exposures (action bits [B, k]): task 0 ("next") is 1, every event
    having been shown; task t >= 1 is the event's action bit t - 1."""
    if actions is None:
        raise ValueError("ranking on logged exposures needs a dataset with actions")
    bits = np.asarray(actions, dtype=np.int64)
    labels = np.ones((*bits.shape, num_tasks), dtype=np.float32)
    for t in range(1, num_tasks):
        labels[:, :, t] = (bits >> (t - 1)) & 1
    return labels
