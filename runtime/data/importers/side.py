"""Side-feature readers: item and user side files into :class:`RawFeatures` (raw ids, raw tokens).

One reader per source layout, each reading only the key and the fields asked for:

- RecBole atomic ``.item`` / ``.user`` files (tab-separated, typed header ``name:type``): ``token`` fields
  hold one value, ``token_seq`` fields space-separated values; ``float``/``float_seq`` fields are not
  categorical (refused by name, left out of "every field").
- S3-Rec ``<name>_item2attributes.json`` (``{"<item id>": [attribute ids]}``): one field, ``attribute``.
- KuaiRand ``video_features_basic_*.csv`` (key ``video_id``) and ``user_features_*.csv`` (key
  ``user_id``). A column is categorical when it is in :data:`KUAIRAND_CATEGORICAL` or named
  ``onehot_feat*``; everything else (durations, counts, sizes, dates) is refused by name and left out.
  ``tag`` cells hold comma-separated tags (``"28,9"``, quoted); integral floats (``"9.0"``, written by
  pandas for columns with gaps) become ``"9"``.
- MovieLens ``u.item`` (19 genre flags -> field ``genre``), ``u.user`` (``age``, ``gender``, ``occupation``,
  ``zip``), ML-1M ``movies.dat`` (``A|B`` genres) and ``users.dat``, ML-20M+ ``movies.csv``.

Empty cells give no values. A malformed row is ``FILE, line N: what`` like a malformed event; so is a key
that appears twice.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from grstack.runtime.data.features import Kind, RawFeatures
from grstack.runtime.data.importers.common import (
    LineCheck,
    bad_line,
    fields_check,
    is_int,
    locate_bad_line,
    numbered_lines,
)
from grstack.runtime.errors import UserError

CATEGORICAL_TYPES = {"token": None, "token_seq": " "}  # RecBole type -> separator of several values
NUMERIC_TYPES = ("float", "float_seq")
ATTRIBUTE_FIELD = "attribute"

KUAIRAND_KEYS: dict[Kind, str] = {"item": "video_id", "user": "user_id"}
KUAIRAND_CATEGORICAL: dict[Kind, tuple[str, ...]] = {
    "item": ("author_id", "video_type", "upload_type", "visible_status", "music_id", "music_type", "tag"),
    "user": ("user_active_degree", "is_lowactive_period", "is_live_streamer", "is_video_author",
             "follow_user_num_range", "fans_user_num_range", "friend_user_num_range", "register_days_range"),
}
KUAIRAND_MULTI = {"tag": ","}  # column -> separator inside a cell
_ONEHOT = re.compile(r"onehot_feat[0-9]+")

ML100K_GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
                 "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi",
                 "Thriller", "War", "Western")
ML_NO_GENRE = "(no genres listed)"

# format -> kind -> glob patterns of its side files (for "auto")
PATTERNS: dict[str, dict[Kind, tuple[str, ...]]] = {
    "recbole": {"item": ("*.item",), "user": ("*.user",)},
    "seqtxt": {"item": ("*_item2attributes.json",)},
    "kuairand": {"item": ("video_features_basic*.csv",), "user": ("user_features*.csv",)},
    "movielens": {"item": ("u.item", "movies.dat", "movies.csv"), "user": ("u.user", "users.dat")},
}


# -- shared helpers -------------------------------------------------------------------------------------------
def _csr(arr: pa.Array | pa.ChunkedArray, sep: str | None,
         integral_floats: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, tokens) of a string column: one value per cell (``sep`` None) or ``sep``-separated values.
    Values are trimmed; empty values and empty cells are dropped. Per-value work (trimming, ``"9.0"`` ->
    ``"9"``, conversion to numpy) is done once per distinct value, through a dictionary encoding."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    arr = pc.fill_null(arr.cast(pa.string()), "")
    n = len(arr)
    if sep is None:
        flat, parent = arr, np.arange(n, dtype=np.int64)
    else:
        lists = pc.split_pattern(arr, sep)
        flat, parent = lists.flatten(), np.asarray(pc.list_parent_indices(lists), dtype=np.int64)
    encoded = pc.dictionary_encode(flat)
    words = pc.utf8_trim_whitespace(encoded.dictionary)
    if integral_floats:
        words = pc.replace_substring_regex(words, r"^(-?[0-9]+)\.0*$", r"\1")
    words_np = (np.asarray(words.to_numpy(zero_copy_only=False), dtype=str) if len(words)
                else np.zeros(0, dtype=str))
    idx = np.asarray(encoded.indices, dtype=np.int64)
    keep = (words_np != "")[idx]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(parent[keep], minlength=n), out=offsets[1:])
    return offsets, words_np[idx[keep]]


def _header_fields(path: Path, delimiter: str) -> list[str]:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        first = f.readline().rstrip("\r\n")
    if not first.strip():
        raise UserError(f"{path}: empty file (no header line)")
    return [n.strip().strip('"') for n in first.split(delimiter)]


def _read_csv(source: Path | io.BytesIO, path: Path, names: list[str], include: list[str], *, delimiter: str,
              quote: bool, skip: int, check: LineCheck, types: dict[str, pa.DataType] | None = None,
              encoding: str = "utf8") -> pa.Table:
    """Every column as strings (``types`` overrides); a parse failure becomes the first bad line's error."""
    column_types = {n: pa.string() for n in include} | (types or {})
    try:
        return pa_csv.read_csv(
            source,
            read_options=pa_csv.ReadOptions(skip_rows=skip, column_names=names, encoding=encoding,
                                            block_size=64 << 20),
            parse_options=pa_csv.ParseOptions(delimiter=delimiter, quote_char='"' if quote else False),
            convert_options=pa_csv.ConvertOptions(column_types=column_types, include_columns=include,
                                                  strings_can_be_null=False),
        )
    except pa.ArrowInvalid as exc:
        raise locate_bad_line(path, numbered_lines(path, skip=skip), check, str(exc)) from None


def _unique_keys(path: Path, keys: np.ndarray, key: str, lines: Iterable[tuple[int, str]],
                 key_of: Callable[[str], str]) -> None:
    """A key listed twice is the second line's error (found by re-reading only when there is one)."""
    ordered = np.sort(keys if keys.dtype.kind in "iu" else keys.astype(str))
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated) == 0:
        return
    dup = str(repeated[0])
    first = None
    for lineno, line in lines:
        if key_of(line) == dup:
            if first is not None:
                raise bad_line(path, lineno, f"{key} {dup} already appeared on line {first}")
            first = lineno
    raise UserError(f"{path}: {key} {dup} appears more than once")


def _choose(path: Path, available: list[str], refused: dict[str, str], fields: list[str] | None) -> list[str]:
    """The fields to read: ``fields`` (each must be available) or every available one."""
    if fields is None:
        return list(available)
    for name in fields:
        if name in refused:
            raise UserError(f"{path}: field {name!r} {refused[name]}, not a categorical feature")
        if name not in available:
            raise UserError(f"{path}: no field {name!r} (categorical fields: {', '.join(available) or 'none'})")
    return list(dict.fromkeys(fields))


# -- RecBole --------------------------------------------------------------------------------------------------
def read_recbole_side(path: Path, kind: Kind, fields: list[str] | None = None,
                      key: str | None = None) -> RawFeatures:
    """A RecBole ``.item``/``.user`` file; ``key`` defaults to ``item_id``/``user_id``."""
    key = key or f"{kind}_id"
    with path.open("r", encoding="utf-8", errors="replace") as f:
        first = f.readline().rstrip("\r\n")
    if not first.strip():
        raise UserError(f"{path}: empty file (no header line)")
    names, types = [], []
    for col in first.split("\t"):
        name, sep, typ = col.partition(":")
        if not sep or not name:
            raise bad_line(path, 1, f"header field {col!r} is not of the form name:type")
        if typ not in CATEGORICAL_TYPES and typ not in NUMERIC_TYPES:
            raise bad_line(path, 1, f"field {name!r} has unknown type {typ!r} "
                                    f"(RecBole types: {', '.join([*CATEGORICAL_TYPES, *NUMERIC_TYPES])})")
        names.append(name)
        types.append(typ)
    if key not in names:
        raise bad_line(path, 1, f"header has no {key!r} field (fields: {', '.join(names)})")
    typ_of = dict(zip(names, types, strict=True))
    available = [n for n in names if n != key and typ_of[n] in CATEGORICAL_TYPES]
    refused = {n: f"has type {typ_of[n]}" for n in names if typ_of[n] in NUMERIC_TYPES}
    chosen = _choose(path, available, refused, fields)
    check = fields_check("\t", names, tokens=[key])
    table = _read_csv(path, path, names, [key, *chosen], delimiter="\t", quote=False, skip=1, check=check)
    keys = table.column(key)  # tokens are exact, as in the .inter file they must match
    if pc.any(pc.equal(keys, "")).as_py():
        raise locate_bad_line(path, numbered_lines(path, skip=1), check, f"empty {key}")
    keys_np = np.asarray(keys.to_numpy(zero_copy_only=False), dtype=str)
    k_idx = names.index(key)
    _unique_keys(path, keys_np, key, numbered_lines(path, skip=1), lambda line: line.split("\t")[k_idx])
    out = {n: _csr(table.column(n), CATEGORICAL_TYPES[typ_of[n]]) for n in chosen}
    return RawFeatures(kind, keys_np, out, str(path))


# -- S3-Rec item2attributes -----------------------------------------------------------------------------------
def read_item2attributes(path: Path, kind: Kind = "item", fields: list[str] | None = None) -> RawFeatures:
    """``{"<item id>": [attribute ids]}``: one field, ``attribute``."""
    if kind != "item":
        raise UserError(f"{path}: an item2attributes file holds item features, not {kind} features")
    _choose(path, [ATTRIBUTE_FIELD], {}, fields)
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UserError(f"{path}: empty file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_line(path, exc.lineno, f"invalid JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object {{\"<item id>\": [attribute ids]}}, "
                        f"got a {type(data).__name__}")
    rows: list[list[str]] = []
    for item, attrs in data.items():
        if not isinstance(attrs, list) or not all(isinstance(a, int) and not isinstance(a, bool) for a in attrs):
            raise UserError(f"{path}: item {item!r}: attributes must be a list of integers, got {attrs!r:.60}")
        rows.append([str(a) for a in attrs])
    counts = np.array([len(r) for r in rows], dtype=np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    tokens = np.array([a for r in rows for a in r], dtype=str) if offsets[-1] else np.zeros(0, dtype=str)
    keys = np.array([k.strip() for k in data], dtype=str)
    if len(np.unique(keys)) != len(keys):  # json keeps the last of duplicate keys; only " 4" vs "4" collide
        raise UserError(f"{path}: some item ids appear twice (after trimming spaces)")
    return RawFeatures("item", keys, {ATTRIBUTE_FIELD: (offsets, tokens)}, str(path))


# -- KuaiRand -------------------------------------------------------------------------------------------------
def kuairand_categorical(kind: Kind, column: str) -> bool:
    """The documented rule: KuaiRand's categorical columns, plus every ``onehot_feat*``."""
    return column in KUAIRAND_CATEGORICAL[kind] or _ONEHOT.fullmatch(column) is not None


def _csv_check(names: list[str], key: str) -> LineCheck:
    """Rows of a quoted CSV (cells like ``"28,9"``): field count and an integer key."""
    k_idx = names.index(key)

    def check(line: str) -> str | None:
        parts = next(csv.reader([line]))
        if len(parts) != len(names):
            return f"expected {len(names)} ','-separated fields, got {len(parts)}"
        if not is_int(parts[k_idx].strip()):
            return f"{key} must be an integer, got {parts[k_idx]!r}"
        return None

    return check


def read_kuairand_side(path: Path, kind: Kind, fields: list[str] | None = None) -> RawFeatures:
    key = KUAIRAND_KEYS[kind]
    names = _header_fields(path, ",")
    if key not in names:
        raise bad_line(path, 1, f"header has no {key!r} column (columns: {', '.join(names)})")
    available = [n for n in names if n != key and kuairand_categorical(kind, n)]
    refused = {n: "is numeric or a date (KuaiRand's categorical columns: "
                  f"{', '.join(KUAIRAND_CATEGORICAL[kind])}, onehot_feat*)"
               for n in names if n != key and n not in available}
    chosen = _choose(path, available, refused, fields)
    check = _csv_check(names, key)
    table = _read_csv(path, path, names, [key, *chosen], delimiter=",", quote=True, skip=1, check=check,
                      types={key: pa.int64()})
    keys = table.column(key)
    if keys.null_count:
        raise locate_bad_line(path, numbered_lines(path, skip=1), check, f"empty {key}")
    keys_np = keys.to_numpy().astype(np.int64)
    k_idx = names.index(key)
    _unique_keys(path, keys_np, key, numbered_lines(path, skip=1),
                 lambda line: str(int(next(csv.reader([line]))[k_idx])))
    out = {n: _csr(table.column(n), KUAIRAND_MULTI.get(n), integral_floats=True) for n in chosen}
    return RawFeatures(kind, keys_np, out, str(path))


# -- MovieLens ------------------------------------------------------------------------------------------------
# layout -> (key, columns in the file, categorical fields, delimiter, header lines, quoted, encoding)
_ML_LAYOUTS: dict[str, tuple[str, list[str], dict[str, str | None], str, int, bool]] = {
    "u.item": ("item_id", ["item_id", "title", "release_date", "video_release_date", "imdb_url",
                           *(f"g{i}" for i in range(len(ML100K_GENRES)))], {"genre": None}, "|", 0, False),
    "u.user": ("user_id", ["user_id", "age", "gender", "occupation", "zip"],
               {"age": None, "gender": None, "occupation": None, "zip": None}, "|", 0, False),
    "movies.dat": ("item_id", ["item_id", "title", "genre"], {"genre": "|"}, "\t", 0, False),
    "users.dat": ("user_id", ["user_id", "gender", "age", "occupation", "zip"],
                  {"gender": None, "age": None, "occupation": None, "zip": None}, "\t", 0, False),
    "movies.csv": ("item_id", ["item_id", "title", "genre"], {"genre": "|"}, ",", 1, True),
}
_ML_KIND = {"u.item": "item", "movies.dat": "item", "movies.csv": "item", "u.user": "user", "users.dat": "user"}


def read_movielens_side(path: Path, kind: Kind, fields: list[str] | None = None) -> RawFeatures:
    """By file name: ``u.item``/``u.user`` (ML-100K), ``movies.dat``/``users.dat`` (ML-1M), ``movies.csv``."""
    layout = path.name
    if layout not in _ML_LAYOUTS:
        raise UserError(f"{path}: not a MovieLens side file (expected one of {', '.join(_ML_LAYOUTS)})")
    if _ML_KIND[layout] != kind:
        raise UserError(f"{path}: {layout} holds {_ML_KIND[layout]} features, not {kind} features")
    key, names, cats, delimiter, skip, quoted = _ML_LAYOUTS[layout]
    chosen = _choose(path, list(cats), {}, fields)
    data = path.read_bytes()
    if not data.strip():
        raise UserError(f"{path}: empty file")
    file_delim = "::" if layout.endswith(".dat") else delimiter
    if layout.endswith(".dat"):
        data = data.replace(b"::", b"\t")  # one-character delimiter for pyarrow; line numbers unchanged
    check = (_csv_check(names, key) if quoted
             else fields_check(file_delim, names, ints=[key]))
    flags = [n for n in names if n.startswith("g") and n[1:].isdigit()]
    include = [key] + (flags if layout == "u.item" and chosen else [n for n in chosen])
    table = _read_csv(io.BytesIO(data), path, names, include, delimiter=delimiter, quote=quoted, skip=skip,
                      check=check, types={key: pa.int64()}, encoding="latin-1")
    keys = table.column(key)
    if keys.null_count:
        raise locate_bad_line(path, numbered_lines(path, skip=skip), check, f"empty {key}")
    keys_np = keys.to_numpy().astype(np.int64)
    k_idx = 0

    def key_of(line: str) -> str:
        parts = next(csv.reader([line])) if quoted else line.split(file_delim)
        return parts[k_idx].strip()

    _unique_keys(path, keys_np, key, numbered_lines(path, skip=skip), key_of)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in chosen:
        if layout == "u.item":
            cols = [np.asarray(table.column(f).to_numpy(zero_copy_only=False), dtype=str) for f in flags]
            bad = [(f, c) for f, c in zip(flags, cols, strict=True) if not np.isin(c, ["0", "1"]).all()]
            if bad:
                genre = ML100K_GENRES[flags.index(bad[0][0])]
                raise locate_bad_line(path, numbered_lines(path), _flag_check(names, flags),
                                      f"genre flag {genre} must be 0 or 1")
            on = np.stack([c == "1" for c in cols], axis=1)
            offsets = np.zeros(len(keys_np) + 1, dtype=np.int64)
            np.cumsum(on.sum(axis=1), out=offsets[1:])
            out[name] = (offsets, np.array(ML100K_GENRES, dtype=str)[np.nonzero(on)[1]])
        else:
            col = table.column(name)
            if name == "genre":
                col = pc.if_else(pc.equal(col, ML_NO_GENRE), "", col)
            out[name] = _csr(col, cats[name])
    return RawFeatures(kind, keys_np, out, str(path))


def _flag_check(names: list[str], flags: list[str]) -> LineCheck:
    base = fields_check("|", names, ints=["item_id"])
    idx = [names.index(f) for f in flags]

    def check(line: str) -> str | None:
        problem = base(line)
        if problem:
            return problem
        parts = line.split("|")
        for g, i in zip(ML100K_GENRES, idx, strict=True):
            if parts[i] not in ("0", "1"):
                return f"genre flag {g} must be 0 or 1, got {parts[i]!r}"
        return None

    return check


# -- dispatch -------------------------------------------------------------------------------------------------
READERS: dict[str, Callable[..., RawFeatures]] = {
    "recbole": read_recbole_side,
    "seqtxt": read_item2attributes,
    "kuairand": read_kuairand_side,
    "movielens": read_movielens_side,
}


def has_reader(fmt: str, kind: Kind) -> bool:
    return kind in PATTERNS.get(fmt, {})


def _no_reader(fmt: str, kind: Kind) -> UserError:
    kinds = " or ".join(PATTERNS.get(fmt, {})) or "no"
    return UserError(f"format {fmt!r} has no {kind} side-feature reader (it reads {kinds} features)")


def find_side_file(fmt: str, kind: Kind, src: str | Path) -> Path | None:
    """The one ``kind`` side file beside the source ``src`` (a file or directory) of format ``fmt``.

    None when there is none (or ``fmt`` has no ``kind`` reader); several candidates are a UserError naming
    them, since picking one would be a guess.
    """
    if not has_reader(fmt, kind):
        return None
    src = Path(src)
    folder = src if src.is_dir() else src.parent
    found = sorted({p for pat in PATTERNS[fmt][kind] for p in folder.glob(pat) if p.is_file()})
    if len(found) > 1:
        raise UserError(f"{folder}: several {kind} side files for format {fmt!r} "
                        f"({', '.join(p.name for p in found)}); name one with --{kind}-features FILE")
    return found[0] if found else None


def resolve_side_file(fmt: str, kind: Kind, src: str | Path, spec: str | Path) -> Path:
    """``spec`` is a path or "auto" (the one matching file beside ``src``)."""
    if not has_reader(fmt, kind):
        raise _no_reader(fmt, kind)
    if str(spec) == "auto":
        found = find_side_file(fmt, kind, src)
        if found is None:
            folder = Path(src) if Path(src).is_dir() else Path(src).parent
            raise UserError(f"{folder}: no {kind} side file for format {fmt!r} "
                            f"(looked for {', '.join(PATTERNS[fmt][kind])})")
        return found
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"{path}: no such {kind} side file")
    return path


def read_side(fmt: str, kind: Kind, path: Path, fields: list[str] | None = None) -> RawFeatures:
    """The ``kind`` side file ``path`` of format ``fmt``, only ``fields`` (None: every categorical field)."""
    if not has_reader(fmt, kind):
        raise _no_reader(fmt, kind)
    raw = READERS[fmt](path, kind, fields)
    if len(raw.keys) == 0:
        raise UserError(f"{path}: lists no {kind} (nothing after the header): a side file needs at least "
                        "one row")
    return raw
