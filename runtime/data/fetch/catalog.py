"""The public datasets ``grstack data fetch`` knows: where each file is published, its pinned size and checksum
(and who published that checksum), which archive members hold the data, and how they are imported.

A file without a published checksum is *unpinned* (``sha256`` and ``md5`` both None): fetch refuses it unless
told ``--allow-unpinned``, and then prints the sha256 it computed so it can be pinned here. Checksums are
never made up: each pinned value names its source in ``checksum_source``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from grstack.runtime.errors import UserError

ARCHIVE_SUFFIXES = {".zip": "zip", ".tar": "tar", ".tar.gz": "tar", ".tgz": "tar"}


@dataclass(frozen=True)
class RemoteFile:
    """One published file. ``name`` is its file name in the cache (and under a ``--url-base`` mirror)."""

    name: str
    url: str
    size: int | None
    sha256: str | None = None
    md5: str | None = None
    checksum_source: str = ""
    unpinned: str = ""  # why there is no checksum to pin (a file must have a checksum or this reason)
    members: tuple[str, ...] = ()  # archives: the members to extract (fnmatch patterns on the member path)

    @property
    def pinned(self) -> bool:
        return self.sha256 is not None or self.md5 is not None

    @property
    def archive(self) -> str | None:
        """"zip" or "tar" (any compression) by the file name; None for a plain file, imported as it is."""
        for suffix, kind in sorted(ARCHIVE_SUFFIXES.items(), key=lambda kv: -len(kv[0])):
            if self.name.endswith(suffix):
                return kind
        return None


@dataclass(frozen=True)
class DataSet:
    """A fetchable dataset: its files, then ``import_dataset(format, <extracted files>, **options)``."""

    name: str
    description: str  # one line, shown by ``fetch --help`` and ``--list``
    files: tuple[RemoteFile, ...]
    format: str
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    aliases: tuple[str, ...] = ()
    homepage: str = ""
    terms: str = ""
    # what the import should give (users/items/events of the dataset, raw_events read from the files): a
    # difference is reported, since it means the files or the import differ from what was published
    expect: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def pinned(self) -> bool:
        return all(f.pinned for f in self.files)


def _opts(**kw: Any) -> Mapping[str, Any]:
    return MappingProxyType(kw)


_GROUPLENS = "https://files.grouplens.org/datasets/movielens"
_TFDS = "tensorflow/datasets tensorflow_datasets/url_checksums/movielens.txt (sha256 and size)"
_ML_TERMS = ("GroupLens usage licence: research use, acknowledge the dataset, no redistribution without "
             "permission (https://grouplens.org/datasets/movielens/)")
_S3REC_COMMIT = "2a81540ae18615d88ef88227b0c066e5b74781e5"
_S3REC_RAW = f"https://raw.githubusercontent.com/RUCAIBox/CIKM2020-S3Rec/{_S3REC_COMMIT}/data"
_AMAZON_TERMS = "Amazon review data 2014 (J. McAuley, UCSD): research use; cite He & McAuley, WWW 2016"
_S3REC_TERMS = "; the S3-Rec repository (RUCAIBox) has no licence file"
_ZENODO = "https://zenodo.org/records/10439422/files"
_KUAIRAND_MD5 = "chongminggao/KuaiRand README.md (the dataset authors' md5 of the Zenodo files)"
_KUAIRAND_TERMS = "CC BY-SA 4.0 (https://kuairand.com)"


def _s3rec_file(name: str, size: int, sha256: str, blob: str) -> RemoteFile:
    return RemoteFile(name, f"{_S3REC_RAW}/{name}", size, sha256=sha256,
                      checksum_source=f"sha256 of git blob {blob} at RUCAIBox/CIKM2020-S3Rec@{_S3REC_COMMIT[:7]}")


def _s3rec(name: str, stem: str, title: str, txt: tuple[int, str, str], attrs: tuple[int, str, str],
           expect: dict[str, int], aliases: tuple[str, ...] = (), terms: str = _AMAZON_TERMS) -> DataSet:
    counts = f"{expect['events']:,} reviews, {expect['users']:,} users, {expect['items']:,} items"
    return DataSet(
        name, f"{title} (S3-Rec 5-core): {counts}; attributes",
        (_s3rec_file(f"{stem}.txt", *txt), _s3rec_file(f"{stem}_item2attributes.json", *attrs)),
        "seqtxt", _opts(item_features="auto"), aliases=aliases,
        homepage="https://github.com/RUCAIBox/CIKM2020-S3Rec", terms=terms + _S3REC_TERMS, expect=MappingProxyType(expect))


def _kuairand(version: str, md5: str, item_features: bool, expect: dict[str, int]) -> DataSet:
    members = ["*/log_standard_*.csv", "*/user_features_*.csv"]
    options: dict[str, Any] = {"user_features": "auto", "timestamp_unit": "ms"}
    if item_features:
        members.append("*/video_features_basic_*.csv")
        options["item_features"] = "auto"
    what = {"Pure": "1.4M exposures, 27,285 users, 7,551 videos", "1K": "11.7M exposures, 1,000 users, 4.4M videos",
            "27K": "322M exposures, 27,285 users, 32M videos (10 GB)"}
    return DataSet(
        f"kuairand-{version.lower()}", f"KuaiRand-{version}: Kuaishou videos, {what[version]}; feedback labels",
        (RemoteFile(f"KuaiRand-{version}.tar.gz", f"{_ZENODO}/KuaiRand-{version}.tar.gz", None, md5=md5,
                    checksum_source=_KUAIRAND_MD5, members=tuple(members)),),
        "kuairand", _opts(**options), homepage="https://kuairand.com", terms=_KUAIRAND_TERMS,
        expect=MappingProxyType(expect))


DATASETS: tuple[DataSet, ...] = (
    DataSet(
        "ml-100k", "MovieLens 100K: 100,000 ratings, 943 users, 1,682 movies; genres, demographics",
        (RemoteFile("ml-100k.zip", f"{_GROUPLENS}/ml-100k.zip", 4_924_029,
                    sha256="50d2a982c66986937beb9ffb3aa76efe955bf3d5c6b761f4e3a7cd717c6a3229", checksum_source=_TFDS,
                    members=("ml-100k/u.data", "ml-100k/u.item", "ml-100k/u.user")),),
        "movielens", _opts(item_features="auto", user_features="auto", timestamp_unit="s"),
        homepage="https://grouplens.org/datasets/movielens/100k/", terms=_ML_TERMS,
        expect=MappingProxyType({"users": 943, "items": 1682, "events": 100_000})),
    DataSet(
        "ml-1m", "MovieLens 1M: 1,000,209 ratings, 6,040 users, 3,706 movies; genres, demographics",
        (RemoteFile("ml-1m.zip", f"{_GROUPLENS}/ml-1m.zip", 5_917_549,
                    sha256="a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20", checksum_source=_TFDS,
                    members=("ml-1m/ratings.dat", "ml-1m/movies.dat", "ml-1m/users.dat")),),
        "movielens", _opts(item_features="auto", user_features="auto", timestamp_unit="s"),
        homepage="https://grouplens.org/datasets/movielens/1m/", terms=_ML_TERMS,
        expect=MappingProxyType({"users": 6040, "items": 3706, "events": 1_000_209})),
    DataSet(
        "ml-20m", "MovieLens 20M: 20,000,263 ratings, 138,493 users, 26,744 movies; genres",
        (RemoteFile("ml-20m.zip", f"{_GROUPLENS}/ml-20m.zip", 198_702_078,
                    sha256="96f243c338a8665f6bcc89c53edf6ee39162a846940de6b7c8c48aeada765ff3", checksum_source=_TFDS,
                    members=("ml-20m/ratings.csv", "ml-20m/movies.csv")),),
        "movielens", _opts(item_features="auto", timestamp_unit="s"),
        homepage="https://grouplens.org/datasets/movielens/20m/", terms=_ML_TERMS,
        expect=MappingProxyType({"users": 138_493, "items": 26_744, "events": 20_000_263})),
    _s3rec("amazon-beauty", "Beauty", "Amazon Beauty",
           (1_090_094, "226cce9c3105299ca0db9615d7d3fb32b3175e90da43100ae352599f0f0107b8",
            "a29773026846d857ec8176cb25f37b23ecf20155"),
           (305_674, "129e40f67486f6877eff0f5318cfa8530ee8ac23d8b0d1de04e1bb7a2ba0b2d4",
            "805189e7a6dd1005ef38344f5d556f27b8dc240f"),
           {"users": 22_363, "items": 12_101, "events": 198_502}, aliases=("beauty",)),
    _s3rec("amazon-sports", "Sports_and_Outdoors", "Amazon Sports and Outdoors",
           (1_707_483, "2a095e0648872beb9982408958290f5d655db5be2911c3756b5446de9f0b8de2",
            "50a7023ca502b42eb0e840c603abda6e851b2018"),
           (653_780, "7fb10733ac4f1811384a52144cdefa7fcc7536fa80a7232c5da9bd789155c34b",
            "7c2e9a40c6534163fd8d6d1e3abfbfb860f137b6"),
           {"users": 35_598, "items": 18_357, "events": 296_337}, aliases=("sports",)),
    _s3rec("amazon-toys", "Toys_and_Games", "Amazon Toys and Games",
           (922_166, "176c680c688d497598c4a89a03b402c0fe78d795e5db335c2e78dd5f2d778a3f",
            "5459307b30f65949605b34d350bfad37586a1b97"),
           (327_536, "d371acd25101eedac04afc727626464b7acec770c4eda708705d51eb76eb1ad0",
            "d13b361c07f57fc032014b86a0723461bbc8e30d"),
           {"users": 19_412, "items": 11_924, "events": 167_597}, aliases=("toys",)),
    _s3rec("yelp", "Yelp", "Yelp businesses",
           (1_814_224, "724b219106b81dd2349027da997334ddb6da9fe2f152ad6e0d97a93170f7caed",
            "d0f642c11487b3bcb515249d676aa1e37a1bb99e"),
           (600_360, "f25acd5e1e680e0b22fd4e3f4fb6be4b2a7461e9222610616e3e1ee6702dd58d",
            "0fa737fd1add345f852c5b789ebcbd57b8fb0282"),
           {"users": 30_431, "items": 20_033, "events": 316_354},
           terms="Yelp Open Dataset: Yelp's dataset terms of use, academic research only"),
    DataSet(
        "amazon-books", "Amazon Books 2014 ratings as in Meta's HSTU tables (items, users with >= 5); unpinned",
        (RemoteFile("ratings_Books.csv",
                    "https://snap.stanford.edu/data/amazon/productGraph/categoryFiles/ratings_Books.csv", None,
                    unpinned="neither SNAP nor UCSD nor Meta's generative-recommenders publishes a checksum"),),
        "amazon", _opts(min_item_count=5, min_user_count=5, min_len=5, timestamp_unit="s"),
        aliases=("amzn-books", "books"),
        homepage="https://cseweb.ucsd.edu/~jmcauley/datasets/amazon/links.html",
        terms=_AMAZON_TERMS),  # Meta's 695,762 items are counted before its 5-rating user cut: not comparable
    _kuairand("Pure", "0820331067a3784d9691136f772b35a7", True, {"raw_events": 1_436_609}),
    _kuairand("1K", "6b0b9c8222d67fcd4c676218edca3f1f", True, {"raw_events": 11_713_045}),
    _kuairand("27K", "3e3c799a24e2d23a4d2c757fbf9adf59", False, {"raw_events": 322_278_385}),
)

CATALOG: dict[str, DataSet] = {d.name: d for d in DATASETS}


def names_and_aliases() -> dict[str, str]:
    """Every accepted spelling -> the dataset's name."""
    out = {d.name: d.name for d in CATALOG.values()}
    out.update({a: d.name for d in CATALOG.values() for a in d.aliases})
    return out


def lookup(name: str) -> DataSet:
    """The dataset called ``name`` (or one of its aliases); a UserError listing the known names if none."""
    canonical = names_and_aliases().get(name.strip().lower())
    if canonical is None:
        raise UserError(f"unknown dataset {name!r} (known: {', '.join(CATALOG)}; `grstack data fetch --list`)")
    return CATALOG[canonical]
