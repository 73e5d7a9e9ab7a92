"""Bad command lines through the real ``grstack`` command, each in its own process: exit status 2, one
``error:`` line naming the problem, no traceback, and no output directory created."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "synthetic-tiny-hstu.yaml")
ROUTER = ["serve", "router", "--rankers", "http://127.0.0.1:1"]
ROOT = os.geteuid() == 0


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "afile").write_text("x\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "u.inter").write_text("user_id:token\titem_id:token\ttimestamp:float\n"
                                      + "".join(f"u{u}\ti{i}\t{u * 10 + i}\n" for u in range(4) for i in range(4)))
    (tmp_path / "header.item").write_text("item_id:token\tcategories:token_seq\n")
    (tmp_path / "garbage.yaml").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "empty.yaml").write_text("")
    return tmp_path


def grstack(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KUBECONFIG": str(cwd / "no-kubeconfig")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.run([sys.executable, "-P", "-m", "grstack.runtime.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=110, check=False)


def assert_one_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr


# (argv, what the one error line says); OUT is a directory that must not exist afterwards
CASES = [
    (["data", "import", "--format", "recbole", "u.inter", "--out", "/proc/x"], "/proc/x cannot be created"),
    (["data", "synth", "--preset", "tiny", "--out", "/proc/x"], "/proc/x cannot be created"),
    (["train", "--config", TINY, "--out", "/proc/x"], "/proc/x cannot be created"),
    (["demo", "--out", "/proc/x"], "/proc/x cannot be created"),
    (["data", "synth", "--preset", "tiny", "--out", "afile/OUT"], "afile is a file, not a directory"),
    (["data", "synth", "--preset", "tiny", "--out", "afile"], "afile is a file, expected a directory"),
    (["data", "import", "--format", "recbole", "u.inter", "--out", "afile"], "afile is a file, expected a directory"),
    (["data", "import", "--format", "recbole", "missing.inter", "--out", "OUT"], "missing.inter does not exist"),
    (["data", "import", "--format", "recbole", "u.inter", "--item-features", "header.item", "--out", "OUT"],
     "header.item"),
    (["data", "import", "--format", "recbole", "u.inter", "--item-features", "adir", "--out", "OUT"],
     "--item-features: adir is a directory, expected a file"),
    (["data", "stats", "afile"], "afile is a file, expected a directory"),
    (["data", "stats", "missing"], "missing does not exist"),
    (["data", "synth", "--preset", "tiny", "--seed", "-1", "--out", "OUT"], "--seed: -1 is out of range"),
    (["train", "--config", "garbage.yaml", "--out", "OUT"], "garbage.yaml: not a text file"),
    (["train", "--config", "empty.yaml", "--out", "OUT"], "empty.yaml: the config is empty"),
    (["train", "--config", "adir", "--out", "OUT"], "--config: adir is a directory, expected a file"),
    (["train", "--config", "no-such.yaml", "--out", "OUT"], "no config named 'no-such.yaml'"),
    (["train", "--config", TINY, "--out", "OUT", "--set", "train.epochs=true"],
     "train.epochs: expected an integer, got true"),
    (["train", "--config", TINY, "--out", "OUT", "--set", "train.epochs='2'"], "train.epochs: expected an integer"),
    (["train", "--config", TINY, "--out", "OUT", "--set", "train.epochs"], "--set: 'train.epochs': expected KEY=VALUE"),
    (["train", "--config", TINY, "--out", "OUT", "--nproc", "0"], "--nproc: 0 is out of range"),
    (["train", "--config", TINY, "--out", "OUT", "--stop-after-step", "-1"], "--stop-after-step: -1 is out of range"),
    (["train", "--config", TINY, "--out", "OUT", "--set", "loss.negatives=100000", "--no-progress"],
     "loss.negatives=100000 is more than the 800 items"),
    (["demo", "--out", "OUT", "--requests", "-5"], "--requests: -5 is out of range"),
    (["demo", "--out", "OUT", "--nproc", "0"], "--nproc: 0 is out of range"),
    (["demo", "--out", "OUT", "--nproc", "-3"], "--nproc: -3 is out of range"),
    (["eval", "--run", "afile"], "--run: afile is a file, expected a directory"),
    (["serve", "ranker", "--checkpoint", "m.pt", "--port", "99999"], "--port: 99999 is not a port number"),
    ([*ROUTER, "--port", "99999"], "--port: 99999 is not a port number"),
    ([*ROUTER, "--host", "999.1.1.1"], "--host: 999.1.1.1 is not a valid IPv4 address"),
    ([*ROUTER, "--log-level", "LOUD"], "--log-level: 'LOUD' is not a log level"),
    (["serve", "router", "--rankers", "notaurl"], "--rankers: 'notaurl' is not an http(s) URL"),
    ([*ROUTER, "--cache-budget-mb", "-1"], "--cache-budget-mb: -1 is out of range"),
    ([*ROUTER, "--rank-timeout-ms", "0"], "--rank-timeout-ms: 0 is out of range"),
    (["serve", "ranker", "--checkpoint", "m.pt", "--max-candidates", "20000"],
     "--max-candidates: 20000 is out of range: must be between 1 and 10000"),
    (["serve", "local", "--checkpoint", "m.pt", "--replicas", "0"], "--replicas: 0 is out of range"),
    (["operator", "--metrics-port", "70000"], "--metrics-port: 70000 is not a port number"),
    (["bench", "mfu", "--config", "adir"], "--config: adir is a directory, expected a file"),
    (["data", "synth", "--preset", "tiny"], "the following arguments are required: --out"),
]


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_error_line_and_writes_nothing(work: Path, argv: list[str], message: str) -> None:
    before = sorted(p.name for p in work.iterdir())
    assert_one_error(grstack(argv, work), message)
    assert sorted(p.name for p in work.iterdir()) == before  # no OUT, nothing partial
    assert not (work / "afile").is_dir() and (work / "adir").is_dir() and not any((work / "adir").iterdir())


def test_a_port_in_use_is_one_error_line(work: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert_one_error(grstack([*ROUTER, "--port", port], work),
                         f"--port {port}: cannot listen on 127.0.0.1:{port} (address already in use)")


@pytest.mark.skipif(ROOT, reason="root reads and writes through permission bits")
def test_permissions(work: Path) -> None:
    secret = work / "secret.yaml"
    secret.write_text("train: {epochs: 1}\n")
    secret.chmod(0)
    (work / "ro").mkdir()
    (work / "ro").chmod(0o555)
    try:
        assert_one_error(grstack(["train", "--config", "secret.yaml", "--out", "OUT"], work),
                         "secret.yaml is not readable (permission denied)")
        assert_one_error(grstack(["data", "synth", "--preset", "tiny", "--out", "ro/OUT"], work),
                         "cannot write in")
        assert_one_error(grstack(["data", "synth", "--preset", "tiny", "--out", "ro"], work), "ro is not writable")
    finally:
        (work / "ro").chmod(0o755)
    assert not (work / "OUT").exists() and not (work / "ro" / "OUT").exists()
