"""Importers, side features and ``grstack data import/stats`` on whole datasets in the real formats: the
shipped fixtures (``format_fixtures.py``) always, the real MovieLens-100K and Beauty files too where this
machine has them (``/work/shared/data``; skipped elsewhere). Every expectation is computed from the files by a
plain reading here, so the same checks hold for both; the real files are also held to the counts their
sources document."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from grstack.runtime.cli import main
from grstack.runtime.data.dataset import read_dataset
from grstack.runtime.data.features import Features
from grstack.runtime.data.importers import import_dataset

from .format_fixtures import BEAUTY_DIR, FIXTURES, ML_DIR, generate, write

pytestmark = pytest.mark.unit

REAL = Path("/work/shared/data")  # this project's machines only; never needed


def _real(folder: str, marker: str, documented: tuple[int, int, int]):
    present = (REAL / folder / marker).is_file()
    return pytest.param(REAL / folder, documented, id=f"real-{folder}",
                        marks=pytest.mark.skipif(not present, reason=f"no real {folder} under {REAL}"))


ML_SETS = [pytest.param(ML_DIR, None, id="fixture"), _real("ml-100k", "ml-100k.inter", (943, 1682, 100_000))]
BEAUTY_SETS = [pytest.param(BEAUTY_DIR, None, id="fixture"),
               _real("amazon-beauty", "Beauty.txt", (22_363, 12_101, 198_502))]


def _one(folder: Path, pattern: str) -> Path:
    (path,) = folder.glob(pattern)
    return path


def _table(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()[1:]]


def _recbole_reference(folder: Path) -> dict[int, list[tuple[float, int, int]]]:
    """user -> (timestamp, item, rating) in time order, ties in file order (Python's sort is stable)."""
    events: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for u, i, r, t in _table(_one(folder, "*.inter")):
        events[int(u)].append((float(t), int(i), int(float(r))))
    return {u: sorted(ev, key=lambda e: e[0]) for u, ev in events.items()}


def _tokens(feats: Features, name: str) -> list[list[str]]:
    f = next(x for x in feats.fields if x.name == name)
    return [f.vocab[f.row(r) - 1].tolist() for r in range(feats.num_rows)]


def test_the_shipped_fixtures_are_the_generators_output(tmp_path: Path) -> None:
    shipped = sorted(p.relative_to(FIXTURES) for p in FIXTURES.rglob("*") if p.is_file())
    assert shipped == sorted(p.relative_to(FIXTURES) for p in generate())
    for path in write(tmp_path):
        assert path.read_text() == (FIXTURES / path.relative_to(tmp_path)).read_text(), path.name


@pytest.mark.parametrize(("folder", "documented"), ML_SETS)
def test_recbole_import_matches_a_plain_reading(folder: Path, documented: tuple[int, int, int] | None) -> None:
    ref = _recbole_reference(folder)
    ds = import_dataset("recbole", folder)
    items = sorted({i for ev in ref.values() for _, i, _ in ev})
    assert (ds.num_users, ds.num_items, ds.num_events) == (len(ref), len(items), sum(map(len, ref.values())))
    assert ds.item_raw_ids.tolist() == items  # numeric order of the raw ids
    for k, user in enumerate(ds.user_ids.tolist()):
        lo, hi = int(ds.offsets[k]), int(ds.offsets[k + 1])
        assert ds.item_raw_ids[ds.sequence(k) - 1].tolist() == [i for _, i, _ in ref[user]], user
        assert ds.timestamps[lo:hi].tolist() == [int(t) for t, _, _ in ref[user]], user
    rated = import_dataset("recbole", folder, ratings=True)
    assert rated.action_names == [f"rating_{r}" for r in range(1, 6)]
    assert np.array_equal(rated.item_ids, ds.item_ids) and (rated.actions & (rated.actions - 1) == 0).all()
    levels = np.log2(rated.actions).astype(int) + 1  # exactly one bit per event
    counts = Counter(r for ev in ref.values() for _, _, r in ev)
    assert np.bincount(levels, minlength=6)[1:].tolist() == [counts[v] for v in range(1, 6)]
    if documented is not None:
        assert (ds.num_users, ds.num_items, ds.num_events) == documented
        assert ds.lengths.min() == 20 and ds.lengths.max() == 737


@pytest.mark.parametrize(("folder", "documented"), BEAUTY_SETS)
def test_seqtxt_import_matches_a_plain_reading(folder: Path, documented: tuple[int, int, int] | None) -> None:
    lines = [list(map(int, line.split())) for line in _one(folder, "Beauty*.txt").read_text().splitlines()]
    ds = import_dataset("seqtxt", folder)
    assert ds.num_users == len(lines) and ds.num_events == sum(len(x) - 1 for x in lines)
    assert np.array_equal(ds.item_raw_ids, np.arange(1, ds.num_items + 1))  # S3-Rec's ids are already dense
    for k, user in enumerate(ds.user_ids.tolist()):
        assert ds.sequence(k).tolist() == lines[user - 1][1:], user
        assert ds.timestamps[ds.offsets[k] : ds.offsets[k + 1]].tolist() == list(range(len(lines[user - 1]) - 1))
    if documented is not None:
        assert (ds.num_users, ds.num_items, ds.num_events) == documented
        assert ds.lengths.min() == 5 and ds.lengths.max() == 204


@pytest.mark.parametrize(("folder", "documented"), ML_SETS)
def test_cli_import_and_stats_with_item_and_user_features(folder: Path, documented: object, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    item_rows = {int(r[0]): r for r in _table(_one(folder, "*.item"))}
    user_rows = {int(r[0]): r for r in _table(_one(folder, "*.user"))}
    genres = {i: r[3].split() for i, r in item_rows.items()}
    out = tmp_path / "ml"
    assert main(["data", "import", "--format", "recbole", str(folder), "--out", str(out),
                 "--item-features", "auto", "--item-fields", "class,release_year",
                 "--user-features", str(_one(folder, "*.user"))]) == 0
    line = capsys.readouterr().out
    n_genres, n_years = len({g for gs in genres.values() for g in gs}), len({r[2] for r in item_rows.values()})
    assert (f"item features class ({n_genres} values, 100.0% covered), release_year ({n_years} values, "
            "100.0% covered)") in line
    user_values = [len({r[c] for r in user_rows.values()}) for c in (1, 2, 3, 4)]
    names = ("age", "gender", "occupation", "zip_code")
    assert ("user features " + ", ".join(f"{name} ({n} values, 100.0% covered)"
                                         for name, n in zip(names, user_values, strict=True))) in line
    ds = read_dataset(out)
    assert ds.item_features.names == ["class", "release_year"] and ds.num_items == len(item_rows)
    raw_items = ds.item_raw_ids.tolist()
    assert _tokens(ds.item_features, "class") == [genres[i] for i in raw_items]  # row r is dense item r + 1
    assert ds.user_features.names == ["age", "gender", "occupation", "zip_code"]
    assert _tokens(ds.user_features, "occupation") == [[user_rows[u][3]] for u in ds.user_ids.tolist()]
    assert main(["data", "stats", str(out)]) == 0
    per_item = sum(map(len, genres.values())) / len(genres)
    text = capsys.readouterr().out
    assert f"item feats  class: {n_genres} values, 100.0% of items covered, {per_item:.2f} per item" in text
    assert f"user feats  age: {user_values[0]} values, 100.0% of users covered, 1.00 per user" in text
    assert main(["data", "stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["features"]["item"]["class"]["values"] == n_genres
    assert stats["features"]["item"]["class"]["mean_per_row"] == pytest.approx(per_item)


@pytest.mark.parametrize(("folder", "documented"), BEAUTY_SETS)
def test_cli_import_with_s3rec_attributes(folder: Path, documented: object, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    attributes = json.loads(_one(folder, "*_item2attributes.json").read_text())
    values = {a for attrs in attributes.values() for a in attrs}
    out = tmp_path / "beauty"
    assert main(["data", "import", "--format", "seqtxt", str(folder), "--out", str(out),
                 "--item-features", "auto"]) == 0
    assert f"item features attribute ({len(values)} values, 100.0% covered)" in capsys.readouterr().out
    ds = read_dataset(out)
    f = ds.item_features.fields[0]
    assert ds.num_items == len(attributes) and f.name == "attribute" and f.num_values == len(values)
    assert np.all(np.diff(f.offsets) > 0) and int(f.offsets[-1]) == sum(map(len, attributes.values()))
    assert _tokens(ds.item_features, "attribute")[:5] == [[str(a) for a in attributes[str(i)]] for i in range(1, 6)]
    assert ds.info["item_features"]["coverage"] == {"attribute": 1.0}
