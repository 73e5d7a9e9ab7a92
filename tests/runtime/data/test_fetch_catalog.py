"""The fetch catalogue, the cache directory's precedence and ``fetched:NAME`` resolution (no network)."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from grstack.runtime.cli import main
from grstack.runtime.data.fetch import cache as fcache
from grstack.runtime.data.fetch.catalog import CATALOG, DATASETS, lookup, names_and_aliases
from grstack.runtime.data.importers import IMPORTERS, import_dataset
from grstack.runtime.data.shards import fingerprint, list_pieces, metadata_only
from grstack.runtime.data.source import known_item_count, load_source
from grstack.runtime.errors import UserError
from grstack.runtime.training_config import DataConfig, load_config

pytestmark = pytest.mark.unit

ISSUE_SETS = {"ml-1m", "ml-20m", "amazon-beauty", "amazon-sports", "amazon-toys", "yelp", "amazon-books",
              "kuairand-pure", "kuairand-1k", "kuairand-27k"}


def test_names_unique_and_the_papers_sets_present() -> None:
    names = [d.name for d in DATASETS]
    assert len(names) == len(set(names)) == len(CATALOG)
    spellings = [*names, *(a for d in DATASETS for a in d.aliases)]
    assert len(spellings) == len(set(spellings))
    assert set(names) >= ISSUE_SETS
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9-]*", s) for s in spellings)


def test_every_file_has_a_url_and_a_checksum_or_a_reason() -> None:
    files = [f for d in DATASETS for f in d.files]
    for f in files:
        assert f.url.startswith("https://") and f.url.rsplit("/", 1)[1] == f.name, f
        if f.pinned:
            assert not f.unpinned and f.checksum_source, f
            if f.sha256 is not None:
                assert re.fullmatch(r"[0-9a-f]{64}", f.sha256), f
            if f.md5 is not None:
                assert re.fullmatch(r"[0-9a-f]{32}", f.md5), f
        else:
            assert f.unpinned, f"{f.name}: no checksum and no reason why"
        assert f.size is None or f.size > 0
        assert bool(f.members) == (f.archive is not None), f  # archives name their members, plain files none
    assert len({f.name for f in files}) == len(files)  # a flat --url-base mirror holds them side by side
    assert not CATALOG["amazon-books"].pinned
    assert all(d.pinned for d in DATASETS if d.name != "amazon-books")


def test_every_import_is_one_the_importer_takes() -> None:
    common = {"item_features", "user_features", "item_fields", "user_fields"}
    for d in DATASETS:
        assert d.format in IMPORTERS, d.name
        accepted = set(inspect.signature(IMPORTERS[d.format]).parameters) | common
        assert set(d.options) <= accepted, d.name
        assert d.description and "\n" not in d.description and len(d.description) <= 100, d.name


def test_lookup_by_alias_and_unknown_name() -> None:
    assert lookup("beauty").name == "amazon-beauty" and lookup("AMZN-BOOKS").name == "amazon-books"
    assert names_and_aliases()["books"] == "amazon-books"
    with pytest.raises(UserError, match=r"unknown dataset 'ml-2m' \(known: ml-100k, ml-1m"):
        lookup("ml-2m")


def test_cache_dir_precedence(tmp_path: Path) -> None:
    env = {"GRSTACK_DATA_DIR": str(tmp_path / "env"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert fcache.cache_dir(tmp_path / "flag", env) == tmp_path / "flag"
    assert fcache.cache_dir(None, env) == tmp_path / "env"
    assert fcache.cache_dir(None, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg/grstack/data"
    assert fcache.cache_dir(None, {}) == Path.home() / ".cache/grstack/data"


def _complete(cache: Path, name: str) -> Path:
    """A cache entry as a fetch leaves it: a (tiny) dataset and its record."""
    out = cache / name / "dataset"
    src = cache / "src.txt"
    src.write_text("1 5 6 7\n2 5 7 8\n")
    from grstack.runtime.data.dataset import write_dataset

    write_dataset(import_dataset("seqtxt", src, name=name), out)
    (cache / name / "fetch.json").write_text(json.dumps({"name": name}))
    return out


def test_resolve_source(tmp_path: Path) -> None:
    assert fcache.resolve_source("data/x", tmp_path) == Path("data/x")
    with pytest.raises(UserError) as err:
        fcache.resolve_source("fetched:ml-1m", tmp_path)
    assert str(err.value) == (f"dataset 'ml-1m' is not in the cache {tmp_path}: run `grstack data fetch ml-1m`")
    with pytest.raises(UserError, match=r"data.source fetched:nope: unknown dataset 'nope'"):
        fcache.resolve_source("fetched:nope", tmp_path)
    (tmp_path / "ml-1m" / "dataset").mkdir(parents=True)  # an import that never finished: not in the cache
    with pytest.raises(UserError, match="is not in the cache"):
        fcache.resolve_source("fetched:ml-1m", tmp_path)
    (tmp_path / "ml-1m" / "dataset").rmdir()
    out = _complete(tmp_path, "ml-1m")
    assert fcache.resolve_source("fetched:ml-1m", tmp_path) == out


def test_configs_read_fetched_data_by_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GRSTACK_DATA_DIR", str(tmp_path))
    cfg = DataConfig(format="parquet", source="fetched:amazon-toys")
    with pytest.raises(UserError, match=r"dataset 'amazon-toys' is not in the cache .*grstack data fetch amazon-toys"):
        load_source(cfg)
    loaded = load_config(None, ["data.format=parquet", "data.source=fetched:toys"])
    assert loaded.data.source == "fetched:toys"  # a name, not a path: resolved where the data is read
    out = _complete(tmp_path, "amazon-toys")
    assert load_source(cfg).num_users == 2 and load_source(loaded.data).num_users == 2
    assert known_item_count(cfg) == 4
    assert list_pieces("fetched:toys", 1) == list_pieces(out, 1)
    assert metadata_only("fetched:amazon-toys").num_items == 4
    assert fingerprint("fetched:toys") == fingerprint(out)
    with pytest.raises(UserError, match=r"needs data\.format parquet, not seqtxt"):
        load_source(DataConfig(format="seqtxt", source="fetched:amazon-toys"))


def test_help_lists_every_set(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["data", "fetch", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for d in DATASETS:
        assert re.search(rf"^  {re.escape(d.name)}\s+{re.escape(d.description)}", out, re.M), d.name
    assert "--cache-dir" in out and "GRSTACK_DATA_DIR" in out and "--url-base" in out


def test_list_and_argument_errors(tmp_path: Path, capsys) -> None:
    _complete(tmp_path, "yelp")
    assert main(["data", "fetch", "--list", "--cache-dir", str(tmp_path)]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows == {d.name: ("fetched" if d.name == "yelp" else "absent") for d in DATASETS}
    for argv, message in [([], "name a dataset to fetch"), (["--list", "ml-1m"], "--list takes no dataset names"),
                          (["ml-1m", "ml-2m"], "unknown dataset 'ml-2m'")]:
        assert main(["data", "fetch", *argv, "--cache-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
