"""Leave-one-out splits and jagged batch assembly from a SequenceDataset (numpy, no padding).

Per user with events ``s[0..n)``: training reads ``s[:-2]`` (every position predicts the next item), the
validation target is ``s[-2]`` given ``s[:-2]``, the test target is ``s[-1]`` given ``s[:-1]``. Histories
are truncated to the most recent ``max_len`` items.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grstack.runtime.data.dataset import SequenceDataset
from grstack.runtime.data.jagged import JaggedBatch

SPLITS = ("valid", "test")


def ranges_index(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of the concatenated ranges [starts[i], ends[i]) and the offsets of each range."""
    lengths = (ends - starts).astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    idx = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1] - starts, lengths)
    return idx, offsets


@dataclass
class LeaveOneOut:
    ds: SequenceDataset
    min_len: int = 3

    def __post_init__(self) -> None:
        lengths = self.ds.lengths
        self.users = np.flatnonzero(lengths >= self.min_len)
        self.starts = self.ds.offsets[:-1][self.users]
        self.ends = self.ds.offsets[1:][self.users]
        # user context (``JaggedBatch.context``): every dataset row's user-feature value ids, fixed width
        feats = self.ds.user_features
        self.context = feats.padded() if feats is not None and feats.fields else None
        # Training uses s[:-2]; a user needs >= 2 training items to give one (input, target) pair.
        self.train_users = np.flatnonzero(self.ends - 2 - self.starts >= 2)

    @staticmethod
    def train_lengths_of(lengths: np.ndarray, min_len: int, max_len: int) -> np.ndarray:
        """History tokens of each training row, for users of these sequence lengths (train_users' order)."""
        n = np.asarray(lengths, dtype=np.int64)
        n = n[n >= min_len]
        n = n[n - 2 >= 2]
        return np.minimum(n - 3, max_len)

    @property
    def num_users(self) -> int:
        return len(self.users)

    def train_batch(self, rows: np.ndarray, max_len: int) -> tuple[JaggedBatch, torch.Tensor]:
        """Inputs ``s[-max_len-3:-3]`` with targets shifted by one, for users at ``rows`` of train_users.

        Also returns each target's timestamp ([sum_L]): the request time of a ranking candidate.
        """
        u = self.train_users[rows]
        end = self.ends[u] - 3  # exclusive end of inputs: the last input predicts s[-3]
        start = np.maximum(self.starts[u], end - max_len)
        idx, offsets = ranges_index(start, end)
        ds = self.ds
        batch = JaggedBatch(
            item_ids=torch.from_numpy(ds.item_ids[idx]),
            offsets=torch.from_numpy(offsets),
            timestamps=torch.from_numpy(ds.timestamps[idx]),
            targets=torch.from_numpy(ds.item_ids[idx + 1]),
            actions=torch.from_numpy(ds.actions[idx + 1]) if ds.actions is not None else None,
            user_index=torch.from_numpy(self.users[u]),
            input_actions=torch.from_numpy(ds.actions[idx]) if ds.actions is not None else None,
            context=self._context(self.users[u]),
        )
        return batch, torch.from_numpy(ds.timestamps[idx + 1])

    def _context(self, ds_rows: np.ndarray) -> torch.Tensor | None:
        return torch.from_numpy(self.context[ds_rows]) if self.context is not None else None

    def eval_batch(self, split: str, rows: np.ndarray, max_len: int) -> tuple[JaggedBatch, torch.Tensor]:
        """History batch and target item per user for ``split`` ('valid' or 'test')."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        target_pos = self.ends[rows] - (2 if split == "valid" else 1)
        start = np.maximum(self.starts[rows], target_pos - max_len)
        idx, offsets = ranges_index(start, target_pos)
        ds = self.ds
        batch = JaggedBatch(
            item_ids=torch.from_numpy(ds.item_ids[idx]),
            offsets=torch.from_numpy(offsets),
            timestamps=torch.from_numpy(ds.timestamps[idx]),
            user_index=torch.from_numpy(self.users[rows]),
            input_actions=torch.from_numpy(ds.actions[idx]) if ds.actions is not None else None,
            context=self._context(self.users[rows]),
        )
        return batch, torch.from_numpy(ds.item_ids[target_pos])

    def eval_targets(self, split: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The ``split`` target of each user at ``rows``: item, timestamp (a ranking candidate's request time)
        and action bits (None when the dataset has none), the labels the ranking head is evaluated on."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        target_pos = self.ends[rows] - (2 if split == "valid" else 1)
        ds = self.ds
        return (ds.item_ids[target_pos], ds.timestamps[target_pos],
                ds.actions[target_pos] if ds.actions is not None else None)

    def full_history(self, split: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """All items before the split's target (for excluding them from ranking): values and offsets."""
        target_pos = self.ends[rows] - (2 if split == "valid" else 1)
        idx, offsets = ranges_index(self.starts[rows], target_pos)
        return self.ds.item_ids[idx], offsets
