"""``grstack data fetch`` end to end against a local HTTP server (with Range support, and able to drop a
connection halfway) serving small archives in each real upstream layout; the catalogue's entries are
re-pinned to these archives' checksums. The network, extraction and import code are the real ones."""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import socket
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest

from grstack.runtime.cli import main
from grstack.runtime.data.dataset import read_dataset
from grstack.runtime.data.fetch import catalog
from grstack.runtime.data.source import load_source
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.training_config import DataConfig, load_config

from .conftest import KUAIRAND_HEADER, kuairand_row

pytestmark = pytest.mark.integration


# -- the server ----------------------------------------------------------------------------------------------
@dataclass
class Served:
    files: dict[str, bytes] = field(default_factory=dict)
    requests: list[tuple[str, str | None]] = field(default_factory=list)
    drop_once: set[str] = field(default_factory=set)  # the next response for these stops halfway
    ignore_range: bool = False
    url: str = ""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer

    def do_GET(self) -> None:
        st: Served = self.server.served  # type: ignore[attr-defined]
        name, rng = self.path.lstrip("/"), self.headers.get("Range")
        st.requests.append((name, rng))
        data = st.files.get(name)
        if data is None:
            self.send_error(404, "Not Found")
            return
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", rng or "")
        if m and not st.ignore_range:
            start = int(m.group(1))
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if name in st.drop_once:
            st.drop_once.discard(name)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Served]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.served = Served(url=f"http://127.0.0.1:{httpd.server_address[1]}")  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.served  # type: ignore[attr-defined]
    finally:
        httpd.shutdown()
        httpd.server_close()


# -- small archives in the upstream layouts ----------------------------------------------------------------------
def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _tar_gz(members: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue())


T0 = 978_300_000  # seconds, as in MovieLens


def ml1m_zip(ratings: str | None = None) -> bytes:
    rows = ratings or "".join(f"{u}::{i}::{(u + i) % 5 + 1}::{T0 + 100 * u + t}\n"
                              for u in (1, 2, 3) for t, i in enumerate((1193, 661, 914, 3408)[: 2 + u]))
    return _zip({"ml-1m/ratings.dat": rows.encode(),
                 "ml-1m/movies.dat": ("1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n"
                                      "661::James and the Giant Peach (1996)::Animation|Children's|Musical\n"
                                      "914::Am\u00e9lie (2001)::Comedy|Romance\n"
                                      "3408::Erin Brockovich (2000)::Drama\n").encode("latin-1"),
                 "ml-1m/users.dat": b"1::F::1::10::48067\n2::M::56::16::70072\n3::M::25::15::55117\n",
                 "ml-1m/README": b"not data\n"})


def ml20m_zip() -> bytes:
    rows = "".join(f"{u},{i},{(u + i) % 10 / 2 + 0.5},{1_112_486_000 + 10 * u + t}\n"
                   for u in (1, 2) for t, i in enumerate((2, 29, 32, 47)))
    return _zip({"ml-20m/ratings.csv": ("userId,movieId,rating,timestamp\n" + rows).encode(),
                 "ml-20m/movies.csv": (b'movieId,title,genres\n2,Jumanji (1995),Adventure|Children\n'
                                       b'29,"City of Lost Children, The (1995)",Adventure|Drama\n'
                                       b'32,Twelve Monkeys (1995),Mystery|Sci-Fi\n47,Seven (1995),Thriller\n'),
                 "ml-20m/tags.csv": b"userId,movieId,tag,timestamp\n1,2,fun,1\n"})


def ml100k_zip() -> bytes:
    flags = ["0"] * 19
    comedy = [*flags[:5], "1", *flags[6:]]
    rows = "".join(f"{u}\t{i}\t{k % 5 + 1}\t{881_250_949 + 60 * u + k}\n"
                   for u in (196, 186) for k, i in enumerate((242, 302, 377, 51)))
    return _zip({"ml-100k/u.data": rows.encode(),
                 "ml-100k/u.item": "".join(f"{i}|Movie {i} (1995)|01-Jan-1995||http://x|{'|'.join(comedy)}\n"
                                           for i in (51, 242, 302, 377)).encode("latin-1"),
                 "ml-100k/u.user": b"186|39|F|executive|00000\n196|49|M|writer|55105\n",
                 "ml-100k/u1.base": b"196\t242\t3\t881250949\n"})


def beauty_files() -> dict[str, bytes]:
    return {"Beauty.txt": b"1 1 2 3\n2 2 3 4 1\n3 4 1 2\n",
            "Beauty_item2attributes.json": b'{"1": [1, 2], "2": [2], "3": [3, 1], "4": [4]}'}


def books_csv() -> bytes:
    """Users A-F rate the same 5 items (kept); G has 1 rating (user filter); H has 5 ratings, one of an item
    rated once, so 4 are left after the item filter and the 5-rating minimum drops H too."""
    items = ["0000000116", "0000013714", "0002005883", "B000GQG7D2", "0195153448"]
    rows = [f"A{u}QUSER,{item},{(u + k) % 5 + 1}.0,{1_019_865_600 + 86_400 * (10 * u + k)}"
            for u in range(6) for k, item in enumerate(items)]
    rows += [f"GUSER,{items[0]},5.0,1300000000"]
    rows += [f"HUSER,{item},4.0,{1_300_000_000 + k}" for k, item in enumerate([*items[:4], "X000ONCE00"])]
    return ("\n".join(rows) + "\n").encode()


BASE_MS = 1_649_376_000_000


def kuairand_pure_tar() -> bytes:
    std1 = KUAIRAND_HEADER + "".join(kuairand_row(u, v, BASE_MS + 1000 * (u * 10 + v), click=v % 2, like=int(v == 3))
                                     for u in (0, 1) for v in (1, 2, 3))
    std2 = KUAIRAND_HEADER + kuairand_row(0, 4, BASE_MS + 999_999, click=1, long_view=1)
    users = ("user_id,user_active_degree,is_lowactive_period,follow_user_num,onehot_feat0\n"
             "0,high_active,0,5,1\n1,full_active,1,12,0\n")
    videos = ("video_id,author_id,video_type,upload_dt,upload_type,visible_status,video_duration,server_width,"
              "server_height,music_id,music_type,tag\n"
              + "".join(f'{v},{v * 7},NORMAL,2022-01-01,ShortImport,1,1000.0,720,1280,9,9.0,"28,{v}"\n'
                        for v in (1, 2, 3, 4)))
    d = "KuaiRand-Pure/data/"
    return _tar_gz({f"{d}log_standard_4_08_to_4_21_pure.csv": std1.encode(),
                    f"{d}log_standard_4_22_to_5_08_pure.csv": std2.encode(),
                    f"{d}log_random_4_22_to_5_08_pure.csv": (KUAIRAND_HEADER + kuairand_row(9, 9, BASE_MS)).encode(),
                    f"{d}user_features_pure.csv": users.encode(), f"{d}video_features_basic_pure.csv": videos.encode(),
                    f"{d}video_features_statistic_pure.csv": b"video_id,counts\n1,2\n",
                    "KuaiRand-Pure/load_data_pure.py": b"print('hi')\n"})


PAYLOADS = {
    "ml-1m": lambda: {"ml-1m.zip": ml1m_zip()},
    "ml-20m": lambda: {"ml-20m.zip": ml20m_zip()},
    "ml-100k": lambda: {"ml-100k.zip": ml100k_zip()},
    "amazon-beauty": beauty_files,
    "amazon-books": lambda: {"ratings_Books.csv": books_csv()},
    "kuairand-pure": lambda: {"KuaiRand-Pure.tar.gz": kuairand_pure_tar()},
}


def pin(monkeypatch: pytest.MonkeyPatch, name: str, payloads: dict[str, bytes], *, pinned: bool = True,
        **changes: object) -> catalog.DataSet:
    """The catalogue entry ``name`` pinned to these payloads' sizes and sha256 (or left unpinned)."""
    entry = catalog.CATALOG[name]
    files = tuple(replace(f, size=len(payloads[f.name]), sha256=hashlib.sha256(payloads[f.name]).hexdigest(),
                          md5=None, unpinned="") if pinned else f for f in entry.files)
    new = replace(entry, files=files, **{"expect": MappingProxyType({}), **changes})
    monkeypatch.setitem(catalog.CATALOG, name, new)
    return new


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("GRSTACK_DATA_DIR", str(cache))
    monkeypatch.delenv("GRSTACK_DATA_URL_BASE", raising=False)
    for var in ("no_proxy", "NO_PROXY"):  # the local server is reached directly, whatever proxy is set
        monkeypatch.setenv(var, "*")
    return cache


def fetch(server: Served, *names: str, extra: tuple[str, ...] = ()) -> int:
    return main(["data", "fetch", *names, "--url-base", server.url, "--no-progress", *extra])


def one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


# -- every format, downloaded, imported, read by the trainer's loader ---------------------------------------
EXPECTED = {  # users, items, events, item feature fields, user feature fields
    "ml-1m": (3, 4, 11, ["genre"], ["gender", "age", "occupation", "zip"]),
    "ml-20m": (2, 4, 8, ["genre"], []),
    "ml-100k": (2, 4, 8, ["genre"], ["age", "gender", "occupation", "zip"]),
    "amazon-beauty": (3, 4, 10, ["attribute"], []),
    "amazon-books": (6, 5, 30, [], []),
    "kuairand-pure": (2, 4, 7, ["author_id", "video_type", "upload_type", "visible_status", "music_id",
                                "music_type", "tag"], ["user_active_degree", "is_lowactive_period", "onehot_feat0"]),
}


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_fetch_imports_every_format(name: str, server: Served, env: Path, monkeypatch, capsys) -> None:
    payloads = PAYLOADS[name]()
    server.files.update(payloads)
    pin(monkeypatch, name, payloads)
    assert fetch(server, name, extra=("--allow-unpinned",) if name == "amazon-books" else ()) == 0
    out = capsys.readouterr().out.strip().splitlines()
    users, items, events, item_fields, user_fields = EXPECTED[name]
    assert out == [f"fetched {name}: {users} users, {items} items, {events} events -> {env / name / 'dataset'} "
                   f"(data.source: fetched:{name})"]
    folder = env / name
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "dataset", "downloads", "fetch.json"]
    assert sorted(p.name for p in (folder / "downloads").iterdir()) == sorted(payloads)

    cfg = DataConfig(format="parquet", source=f"fetched:{name}", item_features=item_fields,
                     user_features=user_fields)
    ds = load_source(cfg)  # what the trainer reads
    assert (ds.num_users, ds.num_items, ds.num_events) == (users, items, events)
    assert (ds.item_features.names if item_fields else None) == (item_fields or None)
    split = LeaveOneOut(ds)
    assert len(split.train_users) > 0
    loaded = load_config(None, ["data.format=parquet", f"data.source=fetched:{name}"])
    assert load_source(loaded.data).num_events == events
    if name.startswith("ml-") or name == "amazon-books":
        assert ds.timestamps.min() > 800_000_000  # Unix seconds, as the files hold them
    if name == "kuairand-pure":
        assert ds.timestamps.min() == BASE_MS // 1000 + 1  # time_ms floored to seconds
        assert ds.action_names[:3] == ["click", "like", "long_view"] and ds.actions is not None
    if name == "amazon-books":
        raw = read_dataset(folder / "dataset").item_raw_ids
        assert list(raw) == sorted(["0000000116", "0000013714", "0002005883", "B000GQG7D2", "0195153448"])


def test_books_filter_matches_meta(tmp_path: Path) -> None:
    """The Amazon importer on its own: the one-pass 5/5 filter, then users with >= 5 ratings."""
    from grstack.runtime.data.importers import import_dataset

    path = tmp_path / "ratings_Books.csv"
    path.write_bytes(books_csv())
    everything = import_dataset("amazon", path, min_len=1)
    assert (everything.num_users, everything.num_items, everything.num_events) == (8, 6, 36)
    meta = import_dataset("amazon", path, min_item_count=5, min_user_count=5, min_len=5)
    assert (meta.num_users, meta.num_items, meta.num_events) == (6, 5, 30)
    assert meta.info["file_events"] == 36


# -- resumable ---------------------------------------------------------------------------------------------------
def test_interrupted_download_resumes_on_the_next_run(server: Served, env: Path, monkeypatch, capsys) -> None:
    payloads = {"ml-1m.zip": ml1m_zip()}
    server.files.update(payloads)
    pin(monkeypatch, "ml-1m", payloads)
    server.drop_once.add("ml-1m.zip")
    assert fetch(server, "ml-1m", extra=("--retries", "0")) == 2
    err = one_error(capsys)
    part = env / "ml-1m" / "downloads" / "ml-1m.zip.part"
    half = len(payloads["ml-1m.zip"]) // 2
    assert "connection closed after" in err and f"{part} ({half} bytes) is kept: rerun to resume" in err
    assert part.stat().st_size == half
    assert sorted(p.name for p in (env / "ml-1m").iterdir()) == [".lock", "downloads"]
    assert main(["data", "fetch", "--list"]) == 0
    assert re.search(r"^ml-1m\s+partial", capsys.readouterr().out, re.M)

    assert fetch(server, "ml-1m") == 0
    assert server.requests == [("ml-1m.zip", None), ("ml-1m.zip", f"bytes={half}-")]
    assert not part.exists() and (env / "ml-1m" / "downloads" / "ml-1m.zip").read_bytes() == payloads["ml-1m.zip"]
    assert load_source(DataConfig(format="parquet", source="fetched:ml-1m")).num_events == 11


def test_dropped_connection_is_retried_within_a_run(server: Served, env: Path, monkeypatch, capsys) -> None:
    payloads = {"KuaiRand-Pure.tar.gz": kuairand_pure_tar()}
    server.files.update(payloads)
    pin(monkeypatch, "kuairand-pure", payloads)
    server.drop_once.add("KuaiRand-Pure.tar.gz")
    assert fetch(server, "kuairand-pure") == 0
    half = len(payloads["KuaiRand-Pure.tar.gz"]) // 2
    assert server.requests == [("KuaiRand-Pure.tar.gz", None), ("KuaiRand-Pure.tar.gz", f"bytes={half}-")]
    assert "fetched kuairand-pure" in capsys.readouterr().out


def test_server_that_ignores_range_restarts_the_file(server: Served, env: Path, monkeypatch, capsys) -> None:
    payloads = {"ml-20m.zip": ml20m_zip()}
    server.files.update(payloads)
    pin(monkeypatch, "ml-20m", payloads)
    server.drop_once.add("ml-20m.zip")
    server.ignore_range = True
    assert fetch(server, "ml-20m") == 0
    assert [r for _, r in server.requests] == [None, f"bytes={len(payloads['ml-20m.zip']) // 2}-"]
    assert (env / "ml-20m" / "downloads" / "ml-20m.zip").read_bytes() == payloads["ml-20m.zip"]


# -- refused -----------------------------------------------------------------------------------------------------
def test_checksum_mismatch_is_refused_and_nothing_kept(server: Served, env: Path, monkeypatch, capsys) -> None:
    good = {"ml-1m.zip": ml1m_zip()}
    pin(monkeypatch, "ml-1m", good)
    tampered = bytearray(good["ml-1m.zip"])
    tampered[-30] ^= 0xFF  # same size, other bytes
    server.files["ml-1m.zip"] = bytes(tampered)
    assert fetch(server, "ml-1m") == 2
    err = one_error(capsys)
    assert err.startswith(f"error: ml-1m.zip from {server.url}/ml-1m.zip: checksum mismatch (sha256 ")
    assert "not the published file, deleted" in err
    assert sorted(p.name for p in (env / "ml-1m").iterdir()) == [".lock", "downloads"]
    assert list((env / "ml-1m" / "downloads").iterdir()) == []
    with pytest.raises(Exception, match="is not in the cache"):
        load_source(DataConfig(format="parquet", source="fetched:ml-1m"))


def test_size_the_server_reports_is_checked_before_downloading(server: Served, env: Path, monkeypatch,
                                                                capsys) -> None:
    pin(monkeypatch, "ml-1m", {"ml-1m.zip": ml1m_zip()})
    server.files["ml-1m.zip"] = ml1m_zip() + b"trailing"
    assert fetch(server, "ml-1m") == 2
    assert "the server has" in one_error(capsys)
    assert list((env / "ml-1m" / "downloads").iterdir()) == []


def test_second_fetch_does_nothing(server: Served, env: Path, monkeypatch, capsys) -> None:
    payloads = beauty_files()
    server.files.update(payloads)
    pin(monkeypatch, "amazon-beauty", payloads)
    assert fetch(server, "beauty") == 0
    capsys.readouterr()
    before = (env / "amazon-beauty" / "fetch.json").read_text()
    server.files.clear()  # a second fetch must not need the server
    assert fetch(server, "amazon-beauty") == 0
    assert capsys.readouterr().out.strip() == (f"amazon-beauty is already in the cache: {env / 'amazon-beauty' / 'dataset'} "
                                               "(3 users, 4 items, 10 events)")
    assert len(server.requests) == 2 and (env / "amazon-beauty" / "fetch.json").read_text() == before


def test_unpinned_file_needs_consent_and_prints_its_sha256(server: Served, env: Path, monkeypatch, capsys) -> None:
    data = books_csv()
    server.files["ratings_Books.csv"] = data
    monkeypatch.setitem(catalog.CATALOG, "amazon-books",
                        replace(catalog.CATALOG["amazon-books"], expect=MappingProxyType({})))
    assert fetch(server, "amazon-books") == 2
    err = one_error(capsys)
    assert "ratings_Books.csv has no published checksum" in err and "--allow-unpinned" in err
    assert server.requests == []  # refused before any download
    assert fetch(server, "amzn-books", extra=("--allow-unpinned",)) == 0
    captured = capsys.readouterr()
    assert f"its sha256 is {hashlib.sha256(data).hexdigest()}" in captured.err
    assert "fetched amazon-books: 6 users, 5 items, 30 events" in captured.out


def test_http_errors_and_network_down(server: Served, env: Path, monkeypatch, capsys) -> None:
    pin(monkeypatch, "ml-1m", {"ml-1m.zip": ml1m_zip()})  # the server does not have it
    assert fetch(server, "ml-1m") == 2
    assert one_error(capsys) == f"error: downloading {server.url}/ml-1m.zip: HTTP 404 Not Found"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["data", "fetch", "ml-1m", "--url-base", closed, "--retries", "0"]) == 2
    err = one_error(capsys)
    assert err.startswith(f"error: downloading {closed}/ml-1m.zip: cannot reach 127.0.0.1") and "refused" in err
    assert not (env / "ml-1m" / "dataset").exists()


def test_mirror_from_the_environment_and_a_file_put_there_by_hand(server: Served, env: Path, monkeypatch,
                                                                  capsys) -> None:
    payloads = {"ml-100k.zip": ml100k_zip()}
    server.files.update(payloads)
    pin(monkeypatch, "ml-100k", payloads)
    monkeypatch.setenv("GRSTACK_DATA_URL_BASE", server.url)
    assert main(["data", "fetch", "ml-100k", "--no-progress"]) == 0
    assert server.requests == [("ml-100k.zip", None)]
    payloads = beauty_files()
    pin(monkeypatch, "amazon-beauty", payloads)
    downloads = env / "amazon-beauty" / "downloads"
    downloads.mkdir(parents=True)
    for fname, data in payloads.items():
        (downloads / fname).write_bytes(data)
    assert main(["data", "fetch", "amazon-beauty"]) == 0  # verified, used, nothing requested
    assert server.requests == [("ml-100k.zip", None)]
    assert "fetched amazon-beauty: 3 users" in capsys.readouterr().out


def test_bad_import_leaves_only_the_verified_download(server: Served, env: Path, monkeypatch, capsys) -> None:
    payloads = {"ml-1m.zip": ml1m_zip(ratings="1::1193::5::978300760\n1::661::x::978300761\n")}
    server.files.update(payloads)
    pin(monkeypatch, "ml-1m", payloads)
    assert fetch(server, "ml-1m") == 2
    assert "ratings.dat, line 2: rating must be a finite number" in one_error(capsys)
    assert sorted(p.name for p in (env / "ml-1m").iterdir()) == [".lock", "downloads"]
    assert fetch(server, "ml-1m") == 2  # the verified download is reused, not fetched again
    assert len(server.requests) == 1


def test_archive_without_the_member(server: Served, env: Path, monkeypatch, capsys) -> None:
    payloads = {"ml-20m.zip": _zip({"ml-20m/ratings.csv": b"userId,movieId,rating,timestamp\n1,2,3,4\n"})}
    server.files.update(payloads)
    pin(monkeypatch, "ml-20m", payloads)
    assert fetch(server, "ml-20m") == 2
    assert "no member matches ml-20m/movies.csv (is it the published archive?)" in one_error(capsys)
    assert not (env / "ml-20m" / "raw").exists() and not (env / "ml-20m" / "dataset").exists()


def test_published_counts_are_compared(server: Served, env: Path, monkeypatch, capsys) -> None:
    payloads = beauty_files()
    server.files.update(payloads)
    pin(monkeypatch, "amazon-beauty", payloads, expect=MappingProxyType({"users": 3, "items": 5}))
    assert fetch(server, "amazon-beauty") == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ["note: amazon-beauty: items 4, published 5"]
    assert np.array_equal(load_source(DataConfig(format="parquet", source="fetched:beauty")).user_ids, [1, 2, 3])


def test_unwritable_cache_and_a_fetch_already_running(server: Served, env: Path, tmp_path: Path, monkeypatch,
                                                      capsys) -> None:
    import fcntl
    import os

    payloads = beauty_files()
    server.files.update(payloads)
    pin(monkeypatch, "amazon-beauty", payloads)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["data", "fetch", "beauty", "--cache-dir", str(blocker / "cache"), "--url-base", server.url]) == 2
    assert one_error(capsys).startswith(f"error: cannot write the cache directory {blocker / 'cache' / 'amazon-beauty'}")
    folder = env / "amazon-beauty"
    folder.mkdir(parents=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert fetch(server, "beauty") == 2
        assert one_error(capsys) == f"error: another `grstack data fetch amazon-beauty` is running on {folder}"
    finally:
        os.close(fd)
    assert server.requests == []
    assert fetch(server, "beauty") == 0
