"""Argument types and the parser class shared by every ``grstack`` subcommand.

Each type checks one flag when argparse reads it, before any work starts, and names the value and what is
wrong with it; :class:`ArgParser` turns argparse's own complaints into a :class:`UsageError`, so every bad
argument ends as one ``error:`` line and exit status 2. Pure standard library: the operator imports it.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import math
import os
import re
import socket
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from grstack.runtime.errors import UserError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_SEED = 2**63 - 1
# argparse's own messages (not a type's): these get a pointer to --help, which says what is expected
_USAGE_MARKERS = ("the following arguments are required", "unrecognized arguments", "invalid choice",
                  "expected one argument", "expected at least one argument", "not allowed with argument",
                  "one of the arguments", "ambiguous option")


class UsageError(UserError):
    """A bad command line, found by the parser."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default or there is
    none worth showing (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is False or default == []
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class ArgParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are a :class:`UsageError` (the CLI prints one line, exit 2) and whose
    help shows every option's default. Subparsers inherit the class."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        if any(marker in message for marker in _USAGE_MARKERS):
            message += f" (see {self.prog} --help)"
        raise UsageError(message)


# -- numbers ----------------------------------------------------------------------------------------------

def _bounds(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None and hi != MAX_SEED:
        return f"between {lo} and {hi}"
    if lo is not None:
        return f"at least {lo}"
    return f"at most {hi}"


def int_range(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An integer in [lo, hi] (None: unbounded on that side); ``true`` or ``1.5`` are refused, not cast."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {_bounds(lo, hi)}")
        return value

    parse.__name__ = "integer"
    return parse


def float_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False) -> Callable[[str], float]:
    """A finite number in the range; ``lo_open``/``hi_open`` exclude that end (``> 0`` rather than ``>= 0``)."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        low_bad = lo is not None and (value <= lo if lo_open else value < lo)
        high_bad = hi is not None and (value >= hi if hi_open else value > hi)
        if low_bad or high_bad:
            parts = []
            if lo is not None:
                parts.append(f"{'>' if lo_open else '>='} {lo:g}")
            if hi is not None:
                parts.append(f"{'<' if hi_open else '<='} {hi:g}")
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: must be {' and '.join(parts)}")
        return value

    parse.__name__ = "number"
    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)
seed = int_range(0, MAX_SEED)
positive_float = float_range(0.0, lo_open=True)
non_negative_float = float_range(0.0)
fraction = float_range(0.0, 1.0, lo_open=True)  # (0, 1]


# -- network ----------------------------------------------------------------------------------------------

def port(text: str, *, allow_zero: bool = True) -> int:
    """A TCP port, 1-65535 (0: any free port, or off, as the flag says)."""
    try:
        value = int(text.strip())
    except ValueError:
        value = -1
    if not (0 if allow_zero else 1) <= value <= 65535:
        zero = "; 0 = any free port or off" if allow_zero else ""
        raise argparse.ArgumentTypeError(f"{text} is not a port number (1-65535{zero})")
    return value


def nonzero_port(text: str) -> int:
    return port(text, allow_zero=False)


_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)(\.[A-Za-z0-9_]([A-Za-z0-9_-]"
                       r"{0,61}[A-Za-z0-9_])?)*\.?")


def _host_problem(text: str, resolve: bool) -> str | None:
    if not text:
        return "empty host"
    try:
        ipaddress.ip_address(text[1:-1] if text.startswith("[") and text.endswith("]") else text)
        return None
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", text):
        return f"{text} is not a valid IPv4 address"
    if ":" in text or not _HOSTNAME.fullmatch(text):
        return f"{text} is not a valid host name or IP address"
    if resolve:
        try:
            socket.getaddrinfo(text, None)
        except (socket.gaierror, UnicodeError):
            return f"{text}: no such host (it does not resolve to an address)"
    return None


def host(text: str) -> str:
    """An address to listen on: an IP literal or a host name that resolves."""
    problem = _host_problem(text.strip(), resolve=True)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text.strip()


def host_port(text: str) -> str:
    """``HOST:PORT`` (a name resolved later, e.g. a headless Service that has no addresses yet)."""
    name, sep, num = text.strip().rpartition(":")
    problem = _host_problem(name, resolve=False) if sep else None
    if not sep or problem:
        raise argparse.ArgumentTypeError(f"{text}: expected HOST:PORT" + (f" ({problem})" if problem else ""))
    nonzero_port(num)
    return text.strip()


def http_url(text: str) -> str:
    """An http(s) URL with a host (and a valid port if one is given); trailing slashes dropped."""
    value = text.strip()
    try:
        url = urlsplit(value)
        url.port  # noqa: B018  (raises on a bad port)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL (e.g. http://127.0.0.1:8081)")
    problem = _host_problem(url.hostname, resolve=False)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return value.rstrip("/")


def url_list(text: str) -> str:
    """Comma-separated http(s) URLs, at least one; returned normalised, still comma-separated."""
    items = [u.strip() for u in text.split(",") if u.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated http(s) URLs")
    return ",".join(http_url(u) for u in items)


def log_level(text: str) -> str:
    value = text.strip().upper()
    if value not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level ({', '.join(LOG_LEVELS)})")
    return value


def check_bindable(host_name: str, port_number: int, flag: str = "--port") -> None:
    """Refuses, before any work, a host:port this process could not listen on (in use, not an address of
    this machine). Port 0 (any free port) is always fine."""
    if port_number == 0:
        return
    try:
        infos = socket.getaddrinfo(host_name, port_number, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(f"--host {host_name}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise UserError(f"{flag} {port_number}: cannot listen on {host_name}:{port_number} "
                            f"({_reason(exc)})") from None


# -- paths ------------------------------------------------------------------------------------------------

def _reason(exc: OSError) -> str:
    known = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
             errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on device",
             errno.EADDRINUSE: "address already in use", errno.EADDRNOTAVAIL: "not an address of this machine"}
    return known.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()


def _stat(p: Path) -> tuple[os.stat_result | None, str | None]:
    """(stat, None), (None, None) when nothing is there, or (None, problem) when it cannot be looked at."""
    try:
        return p.stat(), None
    except FileNotFoundError:
        return None, None
    except NotADirectoryError:
        return None, None
    except OSError as exc:
        return None, f"{p} cannot be reached ({_reason(exc)})"


def input_problem(path: str | os.PathLike, kind: str = "file") -> str | None:
    """Why ``path`` cannot be read as ``kind`` ("file", "dir" or "any"), or None when it can."""
    p = Path(path)
    st, problem = _stat(p)
    if problem:
        return problem
    if st is None:
        return f"{p} does not exist"
    is_dir = stat.S_ISDIR(st.st_mode)
    if kind == "file" and is_dir:
        return f"{p} is a directory, expected a file"
    if kind == "dir" and not is_dir:
        return f"{p} is a file, expected a directory"
    try:
        if is_dir:
            with os.scandir(p):
                pass
        elif stat.S_ISREG(st.st_mode):
            with open(p, "rb"):
                pass
        elif not os.access(p, os.R_OK):
            return f"{p} is not readable (permission denied)"
    except OSError as exc:
        return f"{p} is not readable ({_reason(exc)})"
    return None


def _probe_writable(d: Path) -> str | None:
    """Creates and removes an empty directory in ``d``: the one test root, read-only mounts and /proc agree on."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".grstack-write-check-", dir=d))
    except OSError as exc:
        return _reason(exc)
    return None


def output_dir_problem(path: str | os.PathLike) -> str | None:
    """Why a directory could not be created (or written) at ``path``, or None. Creates nothing."""
    p = Path(path)
    st, problem = _stat(p)
    if problem:
        return problem
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            return f"{p} is a file, expected a directory"
        why = _probe_writable(p)
        return f"{p} is not writable ({why})" if why else None
    ancestor = Path(os.path.abspath(p)).parent
    while True:
        st, problem = _stat(ancestor)
        if problem:
            return f"{p} cannot be created: {problem}"
        if st is not None or ancestor == ancestor.parent:
            break
        ancestor = ancestor.parent
    if st is None or not stat.S_ISDIR(st.st_mode):
        return f"{p} cannot be created: {ancestor} is a file, not a directory"
    why = _probe_writable(ancestor)
    return f"{p} cannot be created: cannot write in {ancestor} ({why})" if why else None


def output_file_problem(path: str | os.PathLike) -> str | None:
    """Why a file could not be written at ``path``, or None. Creates nothing."""
    p = Path(path)
    st, problem = _stat(p)
    if problem:
        return problem
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            return f"{p} is a directory, expected a file"
        if not os.access(p, os.W_OK):
            return f"{p} is not writable (permission denied)"
        return None
    parent = output_dir_problem(Path(os.path.abspath(p)).parent)
    return f"{p} cannot be written: {parent}" if parent else None


def _path_type(check: Callable[[str], str | None], name: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError("empty path")
        problem = check(text)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return text

    parse.__name__ = name
    return parse


input_file = _path_type(lambda t: input_problem(t, "file"), "input file")
input_dir = _path_type(lambda t: input_problem(t, "dir"), "input directory")
input_path = _path_type(lambda t: input_problem(t, "any"), "input path")
output_dir = _path_type(output_dir_problem, "output directory")
output_file = _path_type(output_file_problem, "output file")


def input_file_or_auto(text: str) -> str:
    """A readable file, or ``auto`` (the importer finds the one beside the source)."""
    return text if text == "auto" else input_file(text)


def config_file(text: str) -> str:
    """A readable YAML config: a path, or the name of one in configs/ (with or without ``.yaml``)."""
    from grstack.runtime.config_files import config_path

    p = Path(text)
    if p.exists() or os.sep in text or (os.altsep and os.altsep in text):
        return input_file(text)
    try:
        return str(config_path(text))
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def override(text: str) -> str:
    """One ``--set KEY=VALUE`` (checked against the config when it is loaded)."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip() or not all(part.strip() for part in key.split(".")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. train.epochs=3")
    return text


def positive_int_list(text: str) -> str:
    """Comma-separated positive integers (e.g. ``128,256``), returned as given for the command to split."""
    items = [t for t in (x.strip() for x in text.split(",")) if t]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    for item in items:
        positive_int(item)
    return text
