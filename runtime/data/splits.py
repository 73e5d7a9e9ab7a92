"""Leave-one-out splits and jagged batch assembly from a SequenceDataset (numpy, no padding).

Per user with events ``s[0..n)``: training reads ``s[:-2]`` (every position predicts the next item), the
validation target is ``s[-2]`` given ``s[:-2]``, the test target is ``s[-1]`` given ``s[:-1]``. Histories
are truncated to the most recent ``max_len`` items.

With a ranking ``block`` of ``k`` logged exposures (``loss.ranking_on=exposures``: the ranking head is trained
and evaluated on logged impressions with their own labels, as HSTU ranks KuaiRand) the last ``2k`` events are
two held-out blocks: ``s[-k:]`` the test block (scored given ``s[:-k]``) and ``s[-2k:-k]`` the validation
block (given ``s[:-2k]``). Training reads ``s[:-2k]`` only: by default its last block ``s[-3k:-2k]`` after the
inputs ``s[:-3k]`` (targets shifted by one: the last input predicts the block's first item); with ``back``
(:meth:`LeaveOneOut.block_backs`, drawn per step) the block and the inputs before it end ``back`` events
earlier, so over the epochs every training event is a ranking label, not the same few. Neither held-out
block is ever a training label; the retrieval targets ``s[-2]`` and ``s[-1]`` stay as above (their histories
read held-out events as inputs, never as labels). Users need ``3k + 2`` events.
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


def _train_cut(block: int) -> int:
    """Events at the end of a user's sequence that training's inputs stop before (module doc)."""
    return 3 * block if block > 0 else 3


def _user_min_len(min_len: int, block: int) -> int:
    return max(min_len, 3 * block + 2) if block > 0 else min_len


@dataclass
class LeaveOneOut:
    ds: SequenceDataset
    min_len: int = 3
    block: int = 0  # logged exposures per ranking block (module doc); 0: the plain leave-one-out split

    def __post_init__(self) -> None:
        if self.block < 0:
            raise ValueError(f"block must be >= 0, got {self.block}")
        lengths = self.ds.lengths
        self.users = np.flatnonzero(lengths >= _user_min_len(self.min_len, self.block))
        self.starts = self.ds.offsets[:-1][self.users]
        self.ends = self.ds.offsets[1:][self.users]
        # user context (``JaggedBatch.context``): every dataset row's user-feature value ids, fixed width
        feats = self.ds.user_features
        self.context = feats.padded() if feats is not None and feats.fields else None
        # Training uses s[:-2] (or s[:-3k+1] with blocks); a user needs >= 2 training items to give one
        # (input, target) pair.
        self.train_users = np.flatnonzero(self.ends - (_train_cut(self.block) - 1) - self.starts >= 2)

    @staticmethod
    def train_lengths_of(lengths: np.ndarray, min_len: int, max_len: int, block: int = 0) -> np.ndarray:
        """History tokens of each training row, for users of these sequence lengths (train_users' order)."""
        cut = _train_cut(block)
        n = np.asarray(lengths, dtype=np.int64)
        n = n[n >= _user_min_len(min_len, block)]
        n = n[n - (cut - 1) >= 2]
        return np.minimum(n - cut, max_len)

    @property
    def num_users(self) -> int:
        return len(self.users)

    def train_lengths(self, max_len: int) -> np.ndarray:
        """History tokens of each training row (train_users' order), as :meth:`train_batch` reads them."""
        u = self.train_users
        end = self.ends[u] - _train_cut(self.block)
        return (end - np.maximum(self.starts[u], end - max_len)).astype(np.int64)

    def train_batch(self, rows: np.ndarray, max_len: int, back: np.ndarray | None = None
                    ) -> tuple[JaggedBatch, torch.Tensor]:
        """Inputs ``s[-max_len-3:-3]`` (with blocks ``s[-max_len-3k:-3k]``, ``back`` [B] events earlier when
        given) with targets shifted by one, for users at ``rows`` of train_users.

        Also returns each target's timestamp ([sum_L]): the request time of a ranking candidate.
        """
        u = self.train_users[rows]
        # exclusive end of inputs: the last input predicts s[end]
        end = self.ends[u] - _train_cut(self.block) - (self._check_back(back, u) if back is not None else 0)
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

    def train_block(self, rows: np.ndarray, back: np.ndarray | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The training block (``block`` logged exposures right after :meth:`train_batch`'s inputs with the same
        ``back``) of users at ``rows`` of train_users: item ids [B, k] and action bits [B, k] (None without
        actions)."""
        u = self.train_users[rows]
        start = self.ends[u] - 3 * self._need_block()
        return self._block(start - self._check_back(back, u) if back is not None else start)

    def block_backs(self, rows: np.ndarray, uniform: np.ndarray) -> np.ndarray:
        """How far back each user's training block sits (``back`` of :meth:`train_block`) for ``uniform`` [B]
        draws in [0, 1): every block start from the user's third event to ``s[-3k]`` equally likely."""
        u = self.train_users[rows]
        starts_max = self.ends[u] - 3 * self._need_block() - self.starts[u]  # the latest start, from s[0]
        return np.minimum((np.asarray(uniform, dtype=np.float64) * (starts_max - 1)).astype(np.int64),
                          starts_max - 2)

    def _check_back(self, back: np.ndarray, u: np.ndarray) -> np.ndarray:
        back = np.asarray(back, dtype=np.int64)
        limit = self.ends[u] - _train_cut(self.block) - self.starts[u] - 2
        if back.shape != u.shape or (back < 0).any() or (back > limit).any():
            raise ValueError("back must give every row a block after at least two of its events")
        return back

    def eval_block(self, split: str, rows: np.ndarray, max_len: int
                   ) -> tuple[JaggedBatch, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The ``split`` block of users at ``rows``: the history before it (as :meth:`eval_batch`), its item
        ids [B, k], its first event's timestamp [B] (the request time every candidate carries) and its action
        bits [B, k] (the labels; None without actions)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        k = self._need_block()
        block_start = self.ends[rows] - (2 * k if split == "valid" else k)
        batch = self._history(rows, block_start, max_len)
        ids, acts = self._block(block_start)
        return batch, ids, torch.from_numpy(self.ds.timestamps[block_start]), acts

    def _need_block(self) -> int:
        if self.block <= 0:
            raise ValueError("this split has no ranking blocks (block=0)")
        return self.block

    def _block(self, start: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = np.asarray(start, dtype=np.int64)[:, None] + np.arange(self.block, dtype=np.int64)[None, :]
        ds = self.ds
        return (torch.from_numpy(ds.item_ids[pos]),
                torch.from_numpy(ds.actions[pos]) if ds.actions is not None else None)

    def _history(self, rows: np.ndarray, end: np.ndarray, max_len: int) -> JaggedBatch:
        """The (at most ``max_len``) events before ``end`` of users at ``rows``, as an input batch."""
        start = np.maximum(self.starts[rows], end - max_len)
        idx, offsets = ranges_index(start, end)
        ds = self.ds
        return JaggedBatch(
            item_ids=torch.from_numpy(ds.item_ids[idx]),
            offsets=torch.from_numpy(offsets),
            timestamps=torch.from_numpy(ds.timestamps[idx]),
            user_index=torch.from_numpy(self.users[rows]),
            input_actions=torch.from_numpy(ds.actions[idx]) if ds.actions is not None else None,
            context=self._context(self.users[rows]),
        )

    def _context(self, ds_rows: np.ndarray) -> torch.Tensor | None:
        return torch.from_numpy(self.context[ds_rows]) if self.context is not None else None

    def eval_batch(self, split: str, rows: np.ndarray, max_len: int) -> tuple[JaggedBatch, torch.Tensor]:
        """History batch and target item per user for ``split`` ('valid' or 'test')."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        target_pos = self.ends[rows] - (2 if split == "valid" else 1)
        return self._history(rows, target_pos, max_len), torch.from_numpy(self.ds.item_ids[target_pos])

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
