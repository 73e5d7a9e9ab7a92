"""Leave-one-out splits with ranking blocks of logged exposures (``LeaveOneOut.block``): where the three blocks
sit, that no held-out event is ever a training label, and that every way of reading the training rows agrees."""

import numpy as np
import pytest

from grstack.runtime.data import LeaveOneOut, exposure_labels, from_sequences

pytestmark = pytest.mark.unit

K = 3


def _dataset(lengths=(7, 11, 12, 20, 31)):
    """Users whose item ids are 1000 * user + position, so an id says where it came from."""
    items = [1000 * (u + 1) + np.arange(n) for u, n in enumerate(lengths)]
    ts = [np.arange(n) * 10 + u for u, n in enumerate(lengths)]
    acts = [(np.arange(n) * 5 + u) % 8 for u, n in enumerate(lengths)]
    return from_sequences(list(range(1, len(lengths) + 1)), items, ts, num_items=40_000, actions=acts,
                          action_names=["click", "like", "long_view"])


def _pos(ids):
    """Position of each id in its user's sequence."""
    return np.asarray(ids) % 1000


def test_users_need_three_blocks_and_two_events():
    split = LeaveOneOut(_dataset(), min_len=3, block=K)
    assert list(split.ds.lengths[split.users]) == [11, 12, 20, 31]  # 7 < 3 * 3 + 2
    assert len(split.train_users) == 4
    assert len(LeaveOneOut(_dataset(), min_len=3).users) == 5
    with pytest.raises(ValueError, match="block"):
        LeaveOneOut(_dataset(), block=-1)


def test_blocks_sit_at_the_end_and_no_held_out_event_is_a_training_label():
    ds = _dataset()
    split = LeaveOneOut(ds, min_len=3, block=K)
    rows = np.arange(len(split.train_users))
    batch, target_ts = split.train_batch(rows, max_len=100)
    lengths = ds.lengths[split.users]
    for b, n in enumerate(lengths):
        lo, hi = int(batch.offsets[b]), int(batch.offsets[b + 1])
        inputs, targets = _pos(batch.item_ids[lo:hi]), _pos(batch.targets[lo:hi])
        assert inputs.tolist() == list(range(0, n - 3 * K))
        assert targets.max() == n - 3 * K  # the last input predicts the training block's first event
        assert int(target_ts[hi - 1]) == int(ds.timestamps[ds.offsets[split.users[b]] + n - 3 * K])
    ids, acts = split.train_block(rows)
    assert ids.shape == (4, K)
    for b, n in enumerate(lengths):
        assert _pos(ids[b]).tolist() == list(range(n - 3 * K, n - 2 * K))
        start = ds.offsets[split.users[b]] + n - 3 * K
        assert acts[b].tolist() == ds.actions[start : start + K].tolist()
    for which, lo_block in (("valid", 2 * K), ("test", K)):
        hist, bids, bts, bacts = split.eval_block(which, rows, max_len=100)
        for b, n in enumerate(lengths):
            assert _pos(bids[b]).tolist() == list(range(n - lo_block, n - lo_block + K))
            h = _pos(hist.item_ids[int(hist.offsets[b]) : int(hist.offsets[b + 1])])
            assert h.tolist() == list(range(0, n - lo_block))  # the history stops right before the block
            assert int(bts[b]) == int(ds.timestamps[ds.offsets[split.users[b]] + n - lo_block])
            assert hist.input_actions is not None and bacts is not None
    # training's labels (the retrieval targets and the training block) never reach a held-out block
    for b, n in enumerate(lengths):
        assert _pos(batch.targets[int(batch.offsets[b]) : int(batch.offsets[b + 1])]).max() < n - 2 * K
        assert _pos(ids[b]).max() < n - 2 * K


def test_train_lengths_agree_with_the_batches_and_the_static_form():
    ds = _dataset()
    for block in (0, K):
        split = LeaveOneOut(ds, min_len=3, block=block)
        batch, _ = split.train_batch(np.arange(len(split.train_users)), max_len=6)
        np.testing.assert_array_equal(split.train_lengths(6), batch.lengths.numpy())
        np.testing.assert_array_equal(LeaveOneOut.train_lengths_of(ds.lengths, 3, 6, block), batch.lengths.numpy())
    plain = LeaveOneOut(ds, min_len=3)
    assert plain.train_lengths(100).tolist() == (ds.lengths - 3).tolist()


def test_a_split_without_blocks_refuses_block_reads():
    split = LeaveOneOut(_dataset(), min_len=3)
    with pytest.raises(ValueError, match="no ranking blocks"):
        split.train_block(np.arange(2))
    with pytest.raises(ValueError, match="unknown split"):
        LeaveOneOut(_dataset(), block=K).eval_block("train", np.arange(2), 10)


def test_exposure_labels_are_each_events_own_bits():
    labels = exposure_labels(np.array([[0b001, 0b110], [0b101, 0b000]]), 4)
    assert labels.shape == (2, 2, 4)
    assert labels[:, :, 0].tolist() == [[1, 1], [1, 1]]
    assert labels[:, :, 1].tolist() == [[1, 0], [1, 0]]
    assert labels[:, :, 2].tolist() == [[0, 1], [0, 0]]
    assert labels[:, :, 3].tolist() == [[0, 1], [1, 0]]
    with pytest.raises(ValueError, match="actions"):
        exposure_labels(None, 4)


def test_a_drawn_block_has_its_history_right_before_it_and_every_start_is_reachable():
    ds = _dataset()
    split = LeaveOneOut(ds, min_len=3, block=K)
    rows = np.arange(len(split.train_users))
    lengths = ds.lengths[split.users]
    seen: list[set[int]] = [set() for _ in rows]
    for u01 in np.linspace(0.0, 0.999, 200):
        back = split.block_backs(rows, np.full(len(rows), u01))
        batch, _ = split.train_batch(rows, max_len=100, back=back)
        ids, _ = split.train_block(rows, back)
        for b, n in enumerate(lengths):
            h = _pos(batch.item_ids[int(batch.offsets[b]) : int(batch.offsets[b + 1])])
            start = int(_pos(ids[b])[0])
            assert h.tolist() == list(range(0, start))  # the history stops right before the block
            assert _pos(ids[b]).tolist() == list(range(start, start + K))
            assert start >= 2 and start + K <= n - 2 * K  # never inside a held-out block
            seen[b].add(start)
    for b, n in enumerate(lengths):
        assert seen[b] == set(range(2, n - 3 * K + 1))
    with pytest.raises(ValueError, match="back"):
        split.train_block(rows, np.full(len(rows), 10_000))
