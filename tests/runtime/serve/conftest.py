"""Fixtures for the serving tests: a tiny HSTU, its exported artefact, and a real etcd server."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grstack.runtime.model.hstu import HSTU

NUM_ITEMS = 300
MAX_LEN = 48


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The serving code runs one torch thread per replica; more threads than free cores spin (see ranker.py).
    torch.set_num_threads(1)


def make_model(*, time_bias: bool = True, position_bias: bool = True, num_tasks: int = 2, seed: int = 0,
               max_len: int = MAX_LEN) -> HSTU:
    torch.manual_seed(seed)
    m = HSTU(NUM_ITEMS, max_len=max_len, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0,
             input_dropout=0.0, time_buckets=32, time_bias=time_bias, position_bias=position_bias,
             num_tasks=num_tasks)
    with torch.no_grad():  # larger than the init scale, so attention and biases visibly matter
        for layer in m.layers:
            layer.uvqk.weight.normal_(0.0, 0.3)
            if layer.pos_weight is not None:
                layer.pos_weight.normal_(0.0, 0.5)
            if layer.time_weight is not None:
                layer.time_weight.normal_(0.0, 0.5)
    return m.eval()


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """What tests import from here (test modules cannot import conftest under --import-mode=importlib)."""
    return SimpleNamespace(make_model=make_model, NUM_ITEMS=NUM_ITEMS, MAX_LEN=MAX_LEN, free_port=free_port)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from grstack.runtime.serve.artifact import write_untrained_model

    return write_untrained_model(tmp_path_factory.mktemp("serve-model") / "model.pt", num_items=NUM_ITEMS,
                                 max_len=MAX_LEN, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8,
                                 actions=("click",))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> list[str]:
    """A command prefix that gives etcd SIGKILL if the test process dies without tearing down (util-linux's
    setpriv sets PR_SET_PDEATHSIG). Not a ``preexec_fn``: Python code between fork and exec in a process
    whose gRPC client threads are running can abort the child (it did, restarting etcd mid-test)."""
    return ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []


class EtcdServer:
    """A real single-member etcd on loopback ports with its own data dir (kept across restarts)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"

    def start(self, timeout_s: float = 30.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [*_die_with_parent(), "etcd", "--name", "default", "--data-dir", str(self.data_dir),
               "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"default={peer}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log.open("ab"))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; log: {self.log.read_text()[-2000:]}")
            try:  # /health turns true once the member is leader and serves writes (leases need that)
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd was not healthy on {self.url} within {timeout_s} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def etcd(tmp_path: Path):
    if shutil.which("etcd") is None:
        pytest.skip("SKIPPED LOUDLY: the etcd binary is missing; install Debian's etcd-server "
                    "(apt-get install -y etcd-server) to run the etcd placement tests (CI installs it)")
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    yield server
    server.kill()
