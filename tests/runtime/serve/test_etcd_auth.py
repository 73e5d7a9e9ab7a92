"""Issue #12 item 7 (TLS/auth part): the etcd client's TLS and auth options, from the CLI to aetcd."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import ssl
import subprocess
import urllib.request
from pathlib import Path

import pytest

from grstack.runtime.errors import UserError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def parse(*argv: str) -> argparse.Namespace:
    from grstack.runtime.serve import cli

    parser = argparse.ArgumentParser()
    cli.register(parser)
    return parser.parse_args(list(argv))


def test_flags_reach_the_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grstack.runtime.serve.cli import etcd_auth
    from grstack.runtime.serve.etcd_store import PASSWORD_ENV, EtcdAuth, EtcdPlacementStore

    for name in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / name).write_text("not a real PEM")  # grpc only parses it when the channel opens
    (tmp_path / "pw").write_text("s3cret\n")
    ca, cert, key, pw = (str(tmp_path / n) for n in ("ca.pem", "c.pem", "k.pem", "pw"))
    for role in (["ranker", "--checkpoint", "m.pt"], ["router"]):
        args = parse(*role, "--etcd", "http://127.0.0.1:2379", "--etcd-ca", ca, "--etcd-cert", cert,
                     "--etcd-key", key, "--etcd-user", "grs", "--etcd-password-file", pw)
        assert etcd_auth(args) == EtcdAuth(ca, cert, key, "grs", "s3cret")
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    args = parse("router", "--etcd", "http://127.0.0.1:2379", "--etcd-user", "grs")
    auth = etcd_auth(args)
    assert (auth.user, auth.password, auth.tls_files) == ("grs", "from-env", False)

    store = EtcdPlacementStore("http://127.0.0.1:2379", auth=auth)
    assert (store._client._username, store._client._password, store._client._credentials) == \
        ("grs", "from-env", None)
    assert EtcdPlacementStore("https://127.0.0.1:2379")._client._credentials is not None
    assert EtcdPlacementStore("http://127.0.0.1:2379", auth=EtcdAuth(ca_cert=ca))._client._credentials is not None


@pytest.mark.parametrize("flags, message", [
    (["--etcd-cert", "MISSING", "--etcd-key", "MISSING"], "--etcd-cert MISSING does not exist"),
    (["--etcd-ca", "MISSING"], "--etcd-ca MISSING does not exist"),
    (["--etcd-cert", "x.pem"], "needs both --etcd-cert and --etcd-key"),
    (["--etcd-user", "grs"], "needs both --etcd-user and a password"),
    (["--etcd-user", "grs", "--etcd-password-file", "MISSING"], "--etcd-password-file MISSING"),
])
def test_a_bad_option_is_one_clear_error(flags: list[str], message: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from grstack.runtime.cli import main
    from grstack.runtime.serve.etcd_store import PASSWORD_ENV

    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    flags = [f.replace("MISSING", str(tmp_path / "missing.pem")) for f in flags]
    message = message.replace("MISSING", str(tmp_path / "missing.pem"))
    # The ranker checks them before loading its model: a bogus checkpoint never gets read.
    rc = main(["serve", "ranker", "--checkpoint", str(tmp_path / "nope.pt"), "--etcd", "http://127.0.0.1:1",
               *flags])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    with pytest.raises(UserError, match="needs both"):
        from grstack.runtime.serve.etcd_store import EtcdAuth, EtcdPlacementStore

        EtcdPlacementStore("http://127.0.0.1:1", auth=EtcdAuth(key="k.pem"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _certs(d: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=grstack-test-ca")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")
    return {k: str(d / v) for k, v in {"ca": "ca.pem", "cert": "client.pem", "key": "client.key",
                                       "scert": "server.pem", "skey": "server.key"}.items()}


async def test_a_tls_etcd_with_client_certificates(tmp_path: Path) -> None:
    if not (shutil.which("etcd") and shutil.which("openssl")):
        pytest.skip("SKIPPED LOUDLY: needs the etcd and openssl binaries")
    from grstack.runtime.serve.etcd_store import EtcdAuth, EtcdPlacementStore
    from grstack.runtime.serve.placement import Replica, StoreUnavailable

    c = _certs(tmp_path)
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    log = (tmp_path / "etcd.log").open("wb")
    proc = subprocess.Popen(["etcd", "--data-dir", str(tmp_path / "data"), "--listen-client-urls", url,
                             "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                             "--cert-file", c["scert"], "--key-file", c["skey"], "--trusted-ca-file", c["ca"],
                             "--client-cert-auth"], stdout=subprocess.DEVNULL, stderr=log)
    try:
        ctx = ssl.create_default_context(cafile=c["ca"])
        ctx.load_cert_chain(c["cert"], c["key"])
        for _ in range(150):  # until etcd is healthy (leader elected)
            try:
                with urllib.request.urlopen(url + "/health", timeout=1, context=ctx) as resp:
                    if json.loads(resp.read()).get("health") == "true":
                        break
            except (OSError, ValueError):
                pass
            assert proc.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
            await asyncio.sleep(0.2)
        store = EtcdPlacementStore(url, root="/t", timeout_s=2.0, auth=EtcdAuth(c["ca"], c["cert"], c["key"]))
        await store.register(Replica("r0", "http://127.0.0.1:1"), ttl_s=5)
        assert set(await store.replicas()) == {"r0"}
        await store.close()
        # Without the client certificate the server refuses the handshake.
        bare = EtcdPlacementStore(url, root="/t", timeout_s=2.0, auth=EtcdAuth(ca_cert=c["ca"]))
        with pytest.raises(StoreUnavailable):
            await bare.replicas()
        await bare.close()
    finally:
        proc.kill()
        proc.wait()
