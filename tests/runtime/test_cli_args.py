"""The argument types every subcommand checks its flags with (runtime/cli_args.py), and the parser class."""

from __future__ import annotations

import argparse
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from grstack.runtime import cli_args as ca
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit

ROOT = os.geteuid() == 0  # root reads and writes through any permission bits


def refused(kind, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        kind(text)
    return str(exc.value)


def test_numbers_are_range_checked_and_never_cast() -> None:
    assert ca.positive_int("3") == 3 and ca.non_negative_int("0") == 0 and ca.seed("0") == 0
    assert "out of range: must be at least 1" in refused(ca.positive_int, "0")
    assert "out of range" in refused(ca.seed, "-1")
    assert "is not an integer" in refused(ca.positive_int, "true")
    assert "is not an integer" in refused(ca.positive_int, "1.5")
    assert ca.int_range(1, 10)("10") == 10
    assert "between 1 and 10" in refused(ca.int_range(1, 10), "11")
    assert ca.positive_float("0.5") == 0.5 and ca.non_negative_float("0") == 0.0
    assert "must be > 0" in refused(ca.positive_float, "0")
    assert "must be >= 0" in refused(ca.non_negative_float, "-1")
    for bad in ("nan", "inf", "-inf"):
        assert "not a finite number" in refused(ca.float_range(), bad)
    assert ca.fraction("1") == 1.0 and "must be > 0 and <= 1" in refused(ca.fraction, "1.5")


def test_ports_hosts_urls_and_log_levels() -> None:
    assert ca.port("0") == 0 and ca.port("65535") == 65535 and ca.nonzero_port("1") == 1
    for bad in ("99999", "-1", "http", ""):
        assert "is not a port number" in refused(ca.port, bad)
    assert "is not a port number" in refused(ca.nonzero_port, "0")
    for good in ("127.0.0.1", "0.0.0.0", "::", "::1", "localhost"):
        assert ca.host(good) == good
    assert refused(ca.host, "999.1.1.1") == "999.1.1.1 is not a valid IPv4 address"
    assert "not a valid host name" in refused(ca.host, "bad host!")
    assert "no such host" in refused(ca.host, "no-such-host.invalid")
    assert ca.host_port("rank-ranker:8000") == "rank-ranker:8000"
    for bad in ("no-port", "a:", "a:99999", ":80"):
        assert "HOST:PORT" in refused(ca.host_port, bad) or "port" in refused(ca.host_port, bad)
    assert ca.http_url("http://127.0.0.1:8081/") == "http://127.0.0.1:8081"
    for bad in ("notaurl", "ftp://x", "http://", "http://x:99999", "localhost:8001"):
        refused(ca.http_url, bad)
    assert ca.url_list("http://a:1, https://b:2/") == "http://a:1,https://b:2"
    assert "is not an http(s) URL" in refused(ca.url_list, "http://a:1,notaurl")
    assert "expected comma-separated" in refused(ca.url_list, " , ")
    assert ca.log_level("debug") == "DEBUG"
    assert "is not a log level" in refused(ca.log_level, "LOUD")
    assert ca.positive_int_list("128,256") == "128,256"
    refused(ca.positive_int_list, "128,0")
    assert ca.override("train.epochs=3") == "train.epochs=3"
    for bad in ("train.epochs", "=3", "train..epochs=3", ".x=1"):
        assert "expected KEY=VALUE" in refused(ca.override, bad)


def test_bind_check_names_a_port_in_use() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"--port {taken}: cannot listen on 127.0.0.1:{taken} "
                                            r"\(address already in use\)"):
            ca.check_bindable("127.0.0.1", taken)
    ca.check_bindable("127.0.0.1", 0)  # any free port


def test_input_paths(tmp_path: Path) -> None:
    f = tmp_path / "f.txt"
    f.write_text("x")
    assert ca.input_file(str(f)) == str(f) and ca.input_dir(str(tmp_path)) == str(tmp_path)
    assert ca.input_path(str(f)) == str(f) and ca.input_path(str(tmp_path)) == str(tmp_path)
    assert refused(ca.input_file, str(tmp_path / "none")) == f"{tmp_path / 'none'} does not exist"
    assert refused(ca.input_file, str(tmp_path)) == f"{tmp_path} is a directory, expected a file"
    assert refused(ca.input_dir, str(f)) == f"{f} is a file, expected a directory"
    assert refused(ca.input_file, str(f / "below")) == f"{f / 'below'} does not exist"
    assert ca.input_file_or_auto("auto") == "auto"
    assert "is a directory" in refused(ca.input_file_or_auto, str(tmp_path))
    assert refused(ca.input_file, "") == "empty path"


@pytest.mark.skipif(ROOT, reason="root reads any file")
def test_unreadable_input(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("x")
    f.chmod(0)
    assert refused(ca.input_file, str(f)) == f"{f} is not readable (permission denied)"


def test_output_dirs(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert ca.output_dir(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    assert ca.output_dir(str(tmp_path)) == str(tmp_path)
    assert not (tmp_path / "a").exists()  # checking creates nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert refused(ca.output_dir, str(f)) == f"{f} is a file, expected a directory"
    assert refused(ca.output_dir, str(f / "x" / "y")) == \
        f"{f / 'x' / 'y'} cannot be created: {f} is a file, not a directory"
    assert refused(ca.output_dir, "/proc/x").startswith("/proc/x cannot be created: cannot write in /proc")
    assert ca.output_file(str(tmp_path / "new.json")) == str(tmp_path / "new.json")
    assert refused(ca.output_file, str(tmp_path)) == f"{tmp_path} is a directory, expected a file"
    assert refused(ca.output_file, str(f / "x.json")) == \
        f"{f / 'x.json'} cannot be written: {f} is a file, expected a directory"


@pytest.mark.skipif(ROOT, reason="root writes into read-only directories")
def test_read_only_output_dir(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert refused(ca.output_dir, str(ro)) == f"{ro} is not writable (permission denied)"
        assert refused(ca.output_dir, str(ro / "x")) == \
            f"{ro / 'x'} cannot be created: cannot write in {ro} (permission denied)"
    finally:
        ro.chmod(stat.S_IRWXU)


def test_config_file_names_and_paths(tmp_path: Path) -> None:
    assert ca.config_file("synthetic-tiny-hstu").endswith("synthetic-tiny-hstu.yaml")
    assert "no config named 'nope'" in refused(ca.config_file, "nope")
    assert "is a directory, expected a file" in refused(ca.config_file, str(tmp_path))
    assert refused(ca.config_file, str(tmp_path / "x.yaml")) == f"{tmp_path / 'x.yaml'} does not exist"


def test_parser_errors_are_user_errors_and_help_shows_defaults() -> None:
    parser = ca.ArgParser(prog="t")
    parser.add_argument("--n", type=ca.positive_int, default=3, help="how many")
    parser.add_argument("--flag", action="store_true", help="a switch")
    parser.add_argument("--said", default=4, help="four (default 4)")
    sub = parser.add_subparsers(dest="cmd")
    child = sub.add_parser("child")
    child.add_argument("--m", type=ca.positive_int, default=1, help="m")
    with pytest.raises(ca.UsageError, match=r"^argument --n: 0 is out of range: must be at least 1$"):
        parser.parse_args(["--n", "0"])
    with pytest.raises(UserError, match=r"unrecognized arguments: --x \(see t --help\)"):
        parser.parse_args(["--x"])
    with pytest.raises(UserError, match="argument --m: -2 is out of range"):
        parser.parse_args(["child", "--m", "-2"])
    text = " ".join(parser.format_help().split())
    assert "how many (default: 3)" in text and "a switch" in text and "(default: False)" not in text
    assert "four (default 4)" in text and "(default: 4)" not in text
    assert "m (default: 1)" in " ".join(child.format_help().split())


def _actions(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield path, action


def test_every_flag_of_every_subcommand_has_help() -> None:
    from grstack.runtime.cli import build_parser

    missing = [f"{path} {a.option_strings or a.dest}" for path, a in _actions(build_parser(), "grstack")
               if not a.help]
    assert missing == []


def test_no_torch_for_the_parser() -> None:
    """The operator imports this module: it must stay standard library only."""
    code = "import sys, grstack.runtime.cli_args; sys.exit('torch' in sys.modules or 'numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-P", "-c", code], check=False).returncode == 0
