"""One rank's share of a Parquet dataset, read piece by piece with bounded memory (docs/architecture.md §2).

A *piece* is a Parquet row group (or, when a dataset has fewer row groups than ranks, a slice of one). The
pieces are dealt to ranks from the files' metadata alone (events per row group, longest first onto the
least-loaded rank), so no rank reads anything to learn its share. A rank then reads only its pieces: once
at start-up for the training lengths (the values are dropped at once), and again as training and evaluation
need them, through a small LRU cache of decoded pieces. Nothing here holds more than ``cache_pieces``
decoded pieces.

What the global schedule needs from the other ranks is only ``piece_lengths``: the history length of every
training row of every piece (gathered, not the rows). Every rank computes every rank's epoch order from
them (``epoch_order``: pieces shuffled, then rows shuffled inside windows of ``window`` pieces, so a rank
streams through its pieces in order within an epoch).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from grstack.runtime.data.dataset import SequenceDataset, _check_types, read_meta
from grstack.runtime.data.features import read_features
from grstack.runtime.data.fetch.cache import source_path
from grstack.runtime.data.jagged import JaggedBatch
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.errors import UserError

COLUMNS = ["user_id", "item_ids", "timestamps", "actions"]


@dataclass(frozen=True)
class Piece:
    """Rows ``[row_lo, row_hi)`` of row group ``group`` of ``file`` (``events``: from the metadata)."""

    file: str
    group: int
    row_lo: int
    row_hi: int
    events: int


def _leaf_values(md: pq.RowGroupMetaData, column: str) -> int:
    for j in range(md.num_columns):
        col = md.column(j)
        if col.path_in_schema.split(".")[0] == column:
            return int(col.num_values)
    raise UserError(f"column {column!r} is missing")


def list_pieces(path: str | Path, world_size: int) -> list[Piece]:
    """Every piece of the dataset, in file order: its row groups, each cut into row slices when there are
    fewer row groups than ``world_size`` (so every rank gets some data)."""
    p = source_path(str(path))
    read_meta(p)
    names = sorted(f.name for f in p.glob("part-*.parquet"))
    if not names:
        raise UserError(f"dataset {p} has no part-*.parquet files")
    groups: list[tuple[str, int, int, int]] = []
    for name in names:
        try:
            md = pq.ParquetFile(p / name).metadata
        except (OSError, pa.ArrowInvalid) as exc:
            raise UserError(f"{p / name}: not a readable Parquet file ({exc})") from None
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            try:
                events = _leaf_values(rg, "item_ids")
            except UserError:
                raise UserError(f"{p / name}: column 'item_ids' is missing") from None
            groups.append((name, g, int(rg.num_rows), events))
    cut = max(1, -(-world_size // len(groups)))
    pieces = []
    for name, g, rows, events in groups:
        bounds = np.linspace(0, rows, min(cut, max(rows, 1)) + 1).round().astype(int)
        for lo, hi in itertools.pairwise(bounds):
            if hi > lo:
                pieces.append(Piece(name, g, int(lo), int(hi), events * (hi - lo) // max(rows, 1)))
    return pieces


def deal(pieces: list[Piece], world_size: int) -> list[list[int]]:
    """Piece indices of each rank: longest first onto the rank with the fewest events (ties: lowest rank),
    each rank's list in file order. A pure function of the metadata, so every rank gets the same deal."""
    if len(pieces) < world_size:
        raise UserError(f"the dataset has {len(pieces)} pieces (row-group slices) for {world_size} ranks")
    load = np.zeros(world_size, dtype=np.int64)
    owner = np.empty(len(pieces), dtype=np.int64)
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i].events, i)):
        r = int(np.argmin(load))
        owner[i] = r
        load[r] += pieces[i].events
    return [np.flatnonzero(owner == r).tolist() for r in range(world_size)]


def fingerprint(path: str | Path) -> dict[str, object]:
    """What identifies a dataset directory's content cheaply (names, sizes, meta.json's digest): a resumed
    run checks that its data did not change under it."""
    p = source_path(str(path))
    files = sorted(f for f in p.glob("part-*.parquet"))
    meta = (p / "meta.json").read_bytes()
    return {"path": str(p.resolve()), "meta_sha256": hashlib.sha256(meta).hexdigest(),
            "files": {f.name: f.stat().st_size for f in files}}


def metadata_only(path: str | Path) -> SequenceDataset:
    """A dataset with the directory's name, item count, action names and item features but no users: what
    the trainer needs to know about data it never holds whole (task names, the table size, the exported
    artefact)."""
    path = source_path(str(path))
    meta = read_meta(path)
    has_actions = bool(meta.get("has_actions"))
    empty = np.zeros(0, dtype=np.int64)
    return SequenceDataset(user_ids=empty, offsets=np.zeros(1, dtype=np.int64), item_ids=empty, timestamps=empty,
                           num_items=int(meta["num_items"]), actions=empty if has_actions else None,
                           action_names=list(meta.get("action_names", [])), name=str(meta.get("name", "")),
                           source=str(meta.get("source", "")), info=dict(meta.get("info") or {}),
                           item_features=read_features(Path(path), meta, "item",
                                                       np.arange(1, int(meta["num_items"]) + 1, dtype=np.int64)))


def train_lengths(ds: SequenceDataset, min_len: int, max_len: int, block: int = 0) -> np.ndarray:
    """History tokens of each training row of ``ds`` (LeaveOneOut's train_users, in order)."""
    return LeaveOneOut.train_lengths_of(ds.lengths, min_len, max_len, block)


class RankShare:
    """This rank's pieces of a dataset: their training lengths, and the rows themselves on demand."""

    def __init__(self, path: str | Path, pieces: list[Piece], mine: list[int], *, min_len: int,
                 max_len: int, has_actions: bool, cache_pieces: int = 16, block: int = 0) -> None:
        self.path, self.pieces, self.mine = source_path(str(path)), pieces, list(mine)
        self.min_len, self.max_len, self.has_actions = min_len, max_len, has_actions
        self.block = block  # ranking blocks of logged exposures (LeaveOneOut.block)
        self.cache_pieces = max(1, cache_pieces)
        self._cache: OrderedDict[int, SequenceDataset] = OrderedDict()
        self._lock = threading.Lock()
        self.events_decoded = 0  # every decode, re-reads included
        self._groups: dict[tuple[str, int], int] = {}  # events of each distinct row group decoded
        self.cache_peak = 0
        self.lengths, self.num_users = [], 0
        for i in self.mine:
            ds = self._read(i)
            self.lengths.append(train_lengths(ds, min_len, max_len, block))
            self.num_users += len(self._split_of(ds).users)
        self._bases = np.concatenate([[0], np.cumsum([len(x) for x in self.lengths])]).astype(np.int64)

    @property
    def num_train_rows(self) -> int:
        return int(self._bases[-1])

    @property
    def events_read(self) -> int:
        """Events of the distinct row groups this rank has decoded (its share, whatever the number of passes;
        a row group cut into slices for several ranks counts whole for each)."""
        return sum(self._groups.values())

    def _read(self, i: int) -> SequenceDataset:
        piece = self.pieces[i]
        f = self.path / piece.file
        try:
            pf = pq.ParquetFile(f)
            _check_types(f, pf.schema_arrow)
            cols = [c for c in COLUMNS if c in pf.schema_arrow.names]
            table = pf.read_row_group(piece.group, columns=cols)
        except (OSError, pa.ArrowInvalid) as exc:
            raise UserError(f"{f}: row group {piece.group} cannot be read ({exc})") from None
        decoded = sum(len(chunk.values) for chunk in table.column("item_ids").chunks)  # the whole row group
        self._groups[(piece.file, piece.group)] = decoded
        self.events_decoded += decoded
        return _from_table(table.slice(piece.row_lo, piece.row_hi - piece.row_lo), self.has_actions, f)

    def piece(self, i: int) -> SequenceDataset:
        """Piece ``i`` decoded (through the LRU cache of ``cache_pieces`` pieces)."""
        with self._lock:
            if i in self._cache:
                self._cache.move_to_end(i)
                return self._cache[i]
        ds = self._read(i)
        with self._lock:
            self._cache[i] = ds
            while len(self._cache) > self.cache_pieces:
                self._cache.popitem(last=False)
            self.cache_peak = max(self.cache_peak, len(self._cache))
        return ds

    def train_batch(self, local_rows: np.ndarray, max_len: int, back: np.ndarray | None = None
                    ) -> tuple[JaggedBatch, torch.Tensor]:
        """The training batch of local rows (indices into this rank's training rows, piece-major), in the
        given order: the same tokens ``LeaveOneOut.train_batch`` gives for these users on the whole data."""
        split = self._rows_split(local_rows)
        return split.train_batch(np.arange(len(local_rows)), max_len, back)

    def train_block(self, local_rows: np.ndarray, back: np.ndarray | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``LeaveOneOut.train_block`` of local rows (as :meth:`train_batch`)."""
        return self._rows_split(local_rows).train_block(np.arange(len(local_rows)), back)

    def block_backs(self, local_rows: np.ndarray, uniform: np.ndarray) -> np.ndarray:
        """``LeaveOneOut.block_backs`` of local rows."""
        return self._rows_split(local_rows).block_backs(np.arange(len(local_rows)), uniform)

    def _rows_split(self, local_rows: np.ndarray) -> LeaveOneOut:
        """A split over just these local rows' users, in the given order."""
        local_rows = np.asarray(local_rows, dtype=np.int64)
        k = np.searchsorted(self._bases, local_rows, side="right") - 1
        if len(local_rows) and (local_rows.min() < 0 or local_rows.max() >= self.num_train_rows):
            raise IndexError("a row outside this rank's share")
        items, stamps, acts = [], [], []
        for row, slot in zip(local_rows.tolist(), k.tolist(), strict=True):
            ds = self.piece(self.mine[slot])
            split = self._split_of(ds)
            u = split.users[split.train_users[row - int(self._bases[slot])]]
            lo, hi = int(ds.offsets[u]), int(ds.offsets[u + 1])
            items.append(ds.item_ids[lo:hi])
            stamps.append(ds.timestamps[lo:hi])
            if ds.actions is not None:
                acts.append(ds.actions[lo:hi])
        sub = _concat(items, stamps, acts if self.has_actions else None)
        return LeaveOneOut(sub, min_len=self.min_len, block=self.block)

    def _split_of(self, ds: SequenceDataset) -> LeaveOneOut:
        split = getattr(ds, "_split", None)
        if split is None:
            split = LeaveOneOut(ds, min_len=self.min_len, block=self.block)
            ds._split = split  # type: ignore[attr-defined]
        return split

    def eval_splits(self, pieces_per_chunk: int) -> list[list[int]]:
        """This rank's pieces in chunks of ``pieces_per_chunk``: evaluation reads one chunk at a time."""
        n = max(1, pieces_per_chunk)
        return [self.mine[i : i + n] for i in range(0, len(self.mine), n)]

    def chunk_split(self, chunk: list[int]) -> LeaveOneOut:
        """The leave-one-out split of a chunk of pieces (decoded now, not cached: evaluation streams), with the
        users' own ids (the ranking evaluation's candidate sets are seeded by them)."""
        parts = [self._read(i) for i in chunk]
        items = [p.item_ids[p.offsets[u] : p.offsets[u + 1]] for p in parts for u in range(p.num_users)]
        stamps = [p.timestamps[p.offsets[u] : p.offsets[u + 1]] for p in parts for u in range(p.num_users)]
        acts: list[np.ndarray] | None = None
        if self.has_actions:
            acts = []
            for p in parts:
                assert p.actions is not None  # every piece of a dataset with actions carries them
                acts += [p.actions[p.offsets[u] : p.offsets[u + 1]] for u in range(p.num_users)]
        ds = _concat(items, stamps, acts)
        ds.user_ids = np.concatenate([p.user_ids for p in parts] + [np.zeros(0, np.int64)]).astype(np.int64)
        return LeaveOneOut(ds, min_len=self.min_len, block=self.block)


def _concat(items: list[np.ndarray], stamps: list[np.ndarray], acts: list[np.ndarray] | None) -> SequenceDataset:
    lengths = np.array([len(x) for x in items], dtype=np.int64)
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
    return SequenceDataset(user_ids=np.arange(len(items), dtype=np.int64), offsets=offsets, item_ids=cat(items),
                           timestamps=cat(stamps), num_items=0, actions=cat(acts) if acts is not None else None)


def _from_table(table: pa.Table, has_actions: bool, where: Path) -> SequenceDataset:
    items = table.column("item_ids").combine_chunks()
    stamps = table.column("timestamps").combine_chunks()
    offsets = np.asarray(items.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    t_off = np.asarray(stamps.offsets, dtype=np.int64)
    if not np.array_equal(t_off - t_off[0], offsets):
        raise UserError(f"{where}: item_ids and timestamps have different lengths in some row")
    actions = None
    if has_actions and "actions" in table.column_names:
        actions = np.asarray(table.column("actions").combine_chunks().flatten(), dtype=np.int64)
    return SequenceDataset(user_ids=np.asarray(table.column("user_id"), dtype=np.int64), offsets=offsets,
                           item_ids=np.asarray(items.flatten(), dtype=np.int64),
                           timestamps=np.asarray(stamps.flatten(), dtype=np.int64), num_items=0, actions=actions)


def epoch_order(piece_lengths: list[np.ndarray], seed: int, epoch: int, rank: int, window: int) -> np.ndarray:
    """A rank's training rows (piece-major local indices) in the order it trains on them in ``epoch``: its
    pieces shuffled, then the rows of every ``window`` consecutive pieces shuffled together."""
    bases = np.concatenate([[0], np.cumsum([len(x) for x in piece_lengths])]).astype(np.int64)
    rng = np.random.default_rng([seed, epoch, rank, 0x5EED])
    pieces = rng.permutation(len(piece_lengths))
    out = []
    w = max(1, window)
    for lo in range(0, len(pieces), w):
        rows = np.concatenate([np.arange(bases[p], bases[p + 1]) for p in pieces[lo : lo + w]]
                              + [np.zeros(0, np.int64)])
        out.append(rows[rng.permutation(len(rows))])
    return np.concatenate([*out, np.zeros(0, np.int64)]).astype(np.int64)


__all__ = ["Piece", "RankShare", "deal", "epoch_order", "fingerprint", "list_pieces", "metadata_only",
           "train_lengths"]
