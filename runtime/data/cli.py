"""``grstack data``: import public datasets, synthesise KuaiRand-like data, print dataset statistics."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from grstack.runtime import cli_args
from grstack.runtime.errors import UserError

if TYPE_CHECKING:
    from grstack.runtime.data.dataset import SequenceDataset

FORMATS = ("recbole", "seqtxt", "movielens", "kuairand", "amazon")  # kept in sync with importers.IMPORTERS by a test
PRESETS = ("tiny", "small", "hard", "hard-rank", "27k")  # kept in sync with synth.PRESETS by a test
TIMESTAMP_UNITS = ("auto", "s", "ms", "us")  # kept in sync with importers.timestamps.UNITS by a test


def _check_out(out: Path) -> None:
    """Fails before any work when --out would be refused at write time anyway."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"output directory {out} exists and is not empty")


def _summary(verb: str, ds: SequenceDataset, out: Path, seconds: float) -> str:
    from grstack.runtime.data.features import coverage

    line = (f"{verb} {ds.name}: {ds.num_users} users, {ds.num_items} items, {ds.num_events} events "
            f"-> {out} ({seconds:.1f} s)")
    if ds.info.get("dropped_users"):
        line += f"; dropped {ds.info['dropped_users']} users with < {ds.info['min_len']} events"
    for feats in (ds.item_features, ds.user_features):
        if feats is not None:
            cov = coverage(feats)
            line += f"; {feats.kind} features " + ", ".join(
                f"{f.name} ({f.num_values} values, {cov[f.name]:.1%} covered)" for f in feats.fields)
    return line


def _field_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated field names, got {text!r}")
    return names


def _import(args: argparse.Namespace) -> int:
    from grstack.runtime.data.dataset import write_dataset
    from grstack.runtime.data.importers import import_dataset

    if args.format not in FORMATS:
        raise UserError(f"unknown format {args.format!r} (known: {', '.join(FORMATS)})")
    out = Path(args.out)
    _check_out(out)
    t0 = time.perf_counter()
    opts: dict = {"min_len": args.min_len}
    if args.name:
        opts["name"] = args.name
    if args.clicks_only:
        if args.format != "kuairand":
            raise UserError("--clicks-only applies to --format kuairand only")
        opts["clicks_only"] = True
    if args.rating_actions:
        if args.format not in ("recbole", "movielens"):
            raise UserError("--rating-actions applies to --format recbole or movielens (the formats with ratings)")
        opts["ratings"] = True
    if args.timestamp_unit != "auto":  # formats that have no times refuse a unit by name
        opts["timestamp_unit"] = args.timestamp_unit
    for kind in ("item", "user"):
        side, fields = getattr(args, f"{kind}_features"), getattr(args, f"{kind}_fields")
        if fields is not None and side is None:
            raise UserError(f"--{kind}-fields needs --{kind}-features FILE|auto")
        if side is not None:
            opts[f"{kind}_features"] = side
            opts[f"{kind}_fields"] = fields
    ds = import_dataset(args.format, args.src, **opts)
    write_dataset(ds, out, row_group_size=args.row_group_size)
    print(_summary("imported", ds, out, time.perf_counter() - t0))
    return 0


def _synth(args: argparse.Namespace) -> int:
    from grstack.runtime.data.dataset import write_dataset
    from grstack.runtime.data.synth import synthesize

    if args.preset not in PRESETS:
        raise UserError(f"unknown synth preset {args.preset!r} (known: {', '.join(PRESETS)})")
    out = Path(args.out)
    _check_out(out)
    t0 = time.perf_counter()
    ds = synthesize(args.preset, seed=args.seed)
    write_dataset(ds, out, row_group_size=args.row_group_size)
    print(_summary("generated", ds, out, time.perf_counter() - t0))
    return 0


def _stats(args: argparse.Namespace) -> int:
    from grstack.runtime.data.dataset import read_dataset
    from grstack.runtime.data.stats import dataset_stats, format_stats

    stats = dataset_stats(read_dataset(args.dir))
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


ROW_GROUP_HELP = ("users per Parquet row group (default 4096): the unit ranks split the data by with "
                  "data.read=shard, so a set read by many ranks wants many row groups")


_positive = cli_args.positive_int


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True

    imp = sub.add_parser("import", help="convert a public dataset into the grstack Parquet format",
                         description="Convert a public dataset into the grstack Parquet format. Users are "
                                     "time-ordered (stable on ties), item ids become dense 1..N (the "
                                     "mapping is kept in items.parquet).")
    imp.add_argument("--format", required=True, metavar="{" + ",".join(FORMATS) + "}",
                     help="recbole: RecBole .inter; seqtxt: S3-Rec 'user i1 i2 ...'; movielens: ratings.dat, "
                          "u.data or ratings.csv; kuairand: log_standard_*.csv; amazon: ratings_*.csv "
                          "(Amazon 2014: user,item,rating,timestamp)")
    imp.add_argument("src", type=cli_args.input_path, help="source file, or a directory holding it")
    imp.add_argument("--out", required=True, type=cli_args.output_dir,
                     help="output dataset directory (must not exist or be empty)")
    imp.add_argument("--min-len", type=_positive, default=3,
                     help="drop users with fewer events (default 3: leave-one-out needs train/valid/test)")
    imp.add_argument("--name", default=None, help="dataset name recorded in meta.json (default: from SRC)")
    imp.add_argument("--clicks-only", action="store_true",
                     help="kuairand: keep only clicked exposures "
                          "(default: every exposure, with clicks as actions)")
    imp.add_argument("--rating-actions", action="store_true",
                     help="recbole, movielens: each event's rating becomes its action bits, one per rating level "
                          "(rating_1 ... rating_5), for model.action_inputs")
    imp.add_argument("--row-group-size", type=_positive, default=4096, help=ROW_GROUP_HELP)
    imp.add_argument("--timestamp-unit", choices=TIMESTAMP_UNITS, default="auto",
                     help="unit of the source's timestamps, stored as Unix seconds (default auto: kuairand's "
                          "time_ms is ms; otherwise detected from the values, refusing a file no unit fits)")
    imp.add_argument("--item-features", metavar="FILE|auto", default=None, type=cli_args.input_file_or_auto,
                     help="item side file to attach as categorical item features, or 'auto': the one beside SRC "
                          "(recbole *.item, seqtxt *_item2attributes.json, kuairand video_features_basic*.csv, "
                          "movielens u.item/movies.dat/movies.csv)")
    imp.add_argument("--item-fields", metavar="A,B", type=_field_list, default=None,
                     help="item feature fields to keep (default: every categorical field of the file)")
    imp.add_argument("--user-features", metavar="FILE|auto", default=None, type=cli_args.input_file_or_auto,
                     help="user side file, or 'auto' (recbole *.user, kuairand user_features*.csv, "
                          "movielens u.user/users.dat)")
    imp.add_argument("--user-fields", metavar="A,B", type=_field_list, default=None,
                     help="user feature fields to keep (default: every categorical field of the file)")
    imp.set_defaults(func=_import)

    syn = sub.add_parser("synth", help="generate KuaiRand-27K-like synthetic data",
                         description="Generate KuaiRand-27K-like synthetic data: heavy-tailed lengths, Zipf "
                                     "items, drifting user interests, sessions, click/like/long_view labels. "
                                     "The same seed gives identical data.")
    syn.add_argument("--preset", required=True, metavar="{" + ",".join(PRESETS) + "}",
                     help="tiny: CI (~400 users); small: ~3k users; 27k: 27,285 users, lengths up to 10k")
    syn.add_argument("--seed", type=cli_args.seed, default=0, help="random seed, >= 0 (default 0)")
    syn.add_argument("--out", required=True, type=cli_args.output_dir,
                     help="output dataset directory (must not exist or be empty)")
    syn.add_argument("--row-group-size", type=_positive, default=4096, help=ROW_GROUP_HELP)
    syn.set_defaults(func=_synth)

    st = sub.add_parser("stats", help="print dataset statistics",
                        description="Print users, items, events, length distribution, popularity skew, time "
                                    "span and action rates of a grstack dataset directory.")
    st.add_argument("dir", type=cli_args.input_dir, help="dataset directory")
    st.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    st.set_defaults(func=_stats)

    from grstack.runtime.data.fetch.cli import register as register_fetch

    register_fetch(sub)

