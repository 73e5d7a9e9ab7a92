"""One rank's share of a Parquet dataset: dealt from metadata, read piece by piece, the same batches as the
whole dataset gives, a bounded cache, and a clear error for data that cannot feed the ranks."""

import itertools

import numpy as np
import pytest
import torch
from grstack_testing import cyclic_dataset

from grstack.runtime.data import (
    LeaveOneOut,
    RankShare,
    deal,
    epoch_order,
    fingerprint,
    list_pieces,
    metadata_only,
    read_dataset,
    write_dataset,
)
from grstack.runtime.data.synth import synthesize
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_dataset(synthesize("tiny", seed=3), tmp_path_factory.mktemp("d") / "tiny", row_group_size=48)


def _global_train_rows(full: LeaveOneOut, pieces, mine) -> np.ndarray:
    """Positions in full.train_users of the users in the pieces ``mine``."""
    starts = np.cumsum([0] + [p.row_hi - p.row_lo for p in pieces])
    users = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in mine])
    return np.flatnonzero(np.isin(full.users[full.train_users], users))


def test_the_deal_covers_every_piece_once_and_balances_events(data_dir):
    pieces = list_pieces(data_dir, 3)
    assert len(pieces) >= 3
    parts = deal(pieces, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(pieces)))
    events = [sum(pieces[i].events for i in p) for p in parts]
    assert max(events) <= sum(events) / 3 + max(p.events for p in pieces)
    assert deal(pieces, 3) == parts  # a pure function of the metadata


def test_fewer_row_groups_than_ranks_are_cut_into_row_slices(tmp_path):
    d = write_dataset(cyclic_dataset(num_users=30, max_len=12), tmp_path / "one")  # one row group
    pieces = list_pieces(d, 4)
    assert len(pieces) == 4 and {p.group for p in pieces} == {0}
    assert pieces[0].row_lo == 0 and pieces[-1].row_hi == 30
    assert all(a.row_hi == b.row_lo for a, b in itertools.pairwise(pieces))
    with pytest.raises(UserError, match=r"2 pieces .* for 3 ranks"):
        deal(pieces[:2], 3)


def test_a_share_gives_the_batches_the_whole_dataset_gives(data_dir):
    pieces = list_pieces(data_dir, 2)
    mine = deal(pieces, 2)[1]
    share = RankShare(data_dir, pieces, mine, min_len=3, max_len=20, has_actions=True, cache_pieces=2)
    full = LeaveOneOut(read_dataset(data_dir), min_len=3)
    rows = _global_train_rows(full, pieces, mine)
    assert share.num_train_rows == len(rows)
    assert np.array_equal(np.concatenate(share.lengths), full.train_lengths_of(full.ds.lengths, 3, 20)[rows])
    pick = np.random.default_rng(0).permutation(len(rows))[:40]
    a, a_ts = share.train_batch(pick, 20)
    b, b_ts = full.train_batch(rows[pick], 20)
    for f in ("item_ids", "offsets", "timestamps", "targets", "actions"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert torch.equal(a_ts, b_ts)
    assert share.cache_peak <= 2  # never more decoded pieces than the cache holds
    assert share.events_read == sum(pieces[i].events for i in mine)
    with pytest.raises(IndexError):
        share.train_batch(np.array([share.num_train_rows]), 20)


def test_evaluation_chunks_hold_exactly_the_shares_users(data_dir):
    pieces = list_pieces(data_dir, 2)
    full = LeaveOneOut(read_dataset(data_dir), min_len=3)
    total = 0
    for _rank, mine in enumerate(deal(pieces, 2)):
        share = RankShare(data_dir, pieces, mine, min_len=3, max_len=20, has_actions=True)
        chunks = share.eval_splits(2)
        assert [i for c in chunks for i in c] == mine
        splits = [share.chunk_split(c) for c in chunks]
        assert sum(s.num_users for s in splits) == share.num_users
        total += share.num_users
        # each user's valid and test targets and histories are the ones the whole dataset has for that user
        starts = np.cumsum([0] + [p.row_hi - p.row_lo for p in pieces])
        users = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in mine])
        rows = np.flatnonzero(np.isin(full.users, users))
        for which in ("valid", "test"):
            got = [s.eval_batch(which, np.arange(s.num_users), 20) for s in splits]
            want_batch, want = full.eval_batch(which, rows, 20)
            assert torch.equal(torch.cat([t for _, t in got]), want)
            assert torch.equal(torch.cat([b.item_ids for b, _ in got]), want_batch.item_ids)
            hist = np.concatenate([s.full_history(which, np.arange(s.num_users))[0] for s in splits])
            assert np.array_equal(hist, full.full_history(which, rows)[0])
    assert total == full.num_users


def test_epoch_order_is_a_permutation_that_changes_every_epoch_and_streams_by_window():
    lengths = [np.full(n, 5) for n in (10, 7, 12, 9)]
    a, b = epoch_order(lengths, 0, 0, 1, 2), epoch_order(lengths, 0, 1, 1, 2)
    assert sorted(a.tolist()) == list(range(38)) and sorted(b.tolist()) == list(range(38))
    assert not np.array_equal(a, b) and np.array_equal(a, epoch_order(lengths, 0, 0, 1, 2))
    assert not np.array_equal(a, epoch_order(lengths, 0, 0, 0, 2))  # ranks shuffle independently
    piece_of = np.searchsorted(np.cumsum([0, 10, 7, 12, 9]), a, side="right") - 1
    # window 2: the rows of two pieces, shuffled together, then the rows of the other two
    first = set(piece_of[:1].tolist())
    k = 0
    while len(first | {int(piece_of[k])}) <= 2 and k < len(a) - 1:
        first.add(int(piece_of[k]))
        k += 1
    assert len(first) == 2
    head = sum(len(lengths[p]) for p in first)
    assert set(piece_of[:head].tolist()) == first and not set(piece_of[head:].tolist()) & first


def test_metadata_only_and_fingerprint(data_dir, tmp_path):
    meta = metadata_only(data_dir)
    ds = read_dataset(data_dir)
    assert meta.num_users == 0 and meta.num_items == ds.num_items and meta.action_names == ds.action_names
    assert (meta.actions is None) == (ds.actions is None)
    fp = fingerprint(data_dir)
    assert fp == fingerprint(data_dir) and set(fp["files"]) == {p.name for p in data_dir.glob("part-*.parquet")}


def test_an_unreadable_piece_is_a_user_error(tmp_path):
    d = write_dataset(cyclic_dataset(num_users=40, max_len=12), tmp_path / "d", row_group_size=10)
    pieces = list_pieces(d, 2)
    (d / pieces[0].file).write_bytes(b"not parquet")
    with pytest.raises(UserError, match=r"cannot be read|not a readable"):
        RankShare(d, pieces, deal(pieces, 2)[0] + deal(pieces, 2)[1], min_len=3, max_len=10, has_actions=False)


def test_a_share_with_ranking_blocks_draws_the_blocks_the_whole_dataset_draws(data_dir):
    """loss.ranking_on=exposures on data.read=shard: lengths, batches, drawn blocks and their labels are the
    whole split's for the same users."""
    k = 4
    pieces = list_pieces(data_dir, 2)
    mine = deal(pieces, 2)[0]
    share = RankShare(data_dir, pieces, mine, min_len=3, max_len=20, has_actions=True, block=k)
    full = LeaveOneOut(read_dataset(data_dir), min_len=3, block=k)
    rows = _global_train_rows(full, pieces, mine)
    assert share.num_train_rows == len(rows) and share.num_users == len(rows)
    assert np.array_equal(np.concatenate(share.lengths), full.train_lengths(20)[rows])
    pick = np.random.default_rng(1).permutation(len(rows))[:30]
    u01 = np.random.default_rng(2).random(len(pick))
    back = share.block_backs(pick, u01)
    assert np.array_equal(back, full.block_backs(rows[pick], u01))
    a, a_ts = share.train_batch(pick, 20, back)
    b, b_ts = full.train_batch(rows[pick], 20, back)
    for f in ("item_ids", "offsets", "timestamps", "targets", "input_actions"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert torch.equal(a_ts, b_ts)
    for x, y in zip(share.train_block(pick, back), full.train_block(rows[pick], back), strict=True):
        assert torch.equal(x, y)
