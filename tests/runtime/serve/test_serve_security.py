"""Locked-down serving: bearer tokens, TLS and mTLS between router and rankers, slow and excess connections,
and the deadline header, on real rankers and routers (in-process aiohttp servers on loopback ports)."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from grstack.runtime.errors import UserError
from grstack.runtime.serve import security as sec
from grstack.runtime.serve.ranker import RankerConfig, RankerService, start_ranker
from grstack.runtime.serve.router import Router, RouterConfig, start_router
from grstack.runtime.serve.security import ClientSecurity, ServerSecurity, TokenFile, client_ssl_context

pytestmark = pytest.mark.integration

TOKEN = "client-token-0123456789abcdef"
OTHER = "second-token-0123456789abcdef"
RANKER_TOKEN = "ranker-token-0123456789abcdef"
RANK = {"user_id": "u1", "long_term": {"items": [1, 2, 3], "timestamps": [10, 20, 30]},
        "short_term": {"items": [4], "timestamps": [40]}, "candidates": [5, 6, 7], "timestamp": 50}


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _issue(d: Path, name: str, ca: str, cn: str, san: str | None = None) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
             "-subj", f"/CN={cn}")
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / f"{ca}.crt"), "-CAkey", str(d / f"{ca}.key"),
             "-CAcreateserial", "-days", "2", "-out", str(d / f"{name}.crt"), "-extfile", str(ext))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A CA, a server certificate for localhost/127.0.0.1 and the name ``grstack-ranker``, a client certificate,
    and a client certificate from another CA."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path_factory.mktemp("certs")
    for ca in ("ca", "rogue-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / f"{ca}.key"), "-out",
                 str(d / f"{ca}.crt"), "-days", "2", "-subj", f"/CN={ca}")
    _issue(d, "server", "ca", "localhost", "DNS:localhost,DNS:grstack-ranker,IP:127.0.0.1")
    _issue(d, "client", "ca", "router")
    _issue(d, "rogue", "rogue-ca", "router")
    return SimpleNamespace(dir=d, ca=str(d / "ca.crt"), cert=str(d / "server.crt"), key=str(d / "server.key"),
                           client_cert=str(d / "client.crt"), client_key=str(d / "client.key"),
                           rogue_cert=str(d / "rogue.crt"), rogue_key=str(d / "rogue.key"))


def token_file(tmp_path: Path, *tokens: str, name: str = "tokens") -> TokenFile:
    path = tmp_path / name
    path.write_text("# serving tokens\n" + "\n".join(tokens) + "\n")
    return TokenFile(path)


@pytest.fixture
async def start(kit: SimpleNamespace):
    """start(security) -> (runner, url) of a ranker; everything started is cleaned up."""
    runners = []

    async def ranker(security: ServerSecurity | None = None) -> tuple[RankerService, str]:
        service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8))
        runner, url = await start_ranker(service, security=security)
        runners.append(runner)
        return service, url

    async def router(rankers: tuple[str, ...], security: ServerSecurity | None = None,
                     client: ClientSecurity | None = None) -> tuple[Router, str]:
        r = Router(RouterConfig(rankers=rankers, startup_timeout_s=3.0, load_poll_interval_s=0), client=client)
        runner, url = await start_router(r, security=security)
        runners.append(runner)
        return r, url

    yield SimpleNamespace(ranker=ranker, router=router)
    for runner in reversed(runners):
        await runner.cleanup()


async def call(url: str, method: str = "POST", path: str = "/v1/rank", body: dict | None = None,
               headers: dict[str, str] | None = None, ssl_ctx: ssl.SSLContext | bool = True) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_ctx)) as http:
        data = json.dumps(body if body is not None else RANK).encode() if method == "POST" else None
        async with http.request(method, url + path, data=data, headers=headers) as resp:
            return resp.status, await resp.read(), dict(resp.headers)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# -- tokens --------------------------------------------------------------------------------------------------
async def test_ranker_tokens(start: SimpleNamespace, tmp_path: Path) -> None:
    _, url = await start.ranker(ServerSecurity(tokens=token_file(tmp_path, TOKEN, OTHER)))
    for headers in (None, bearer("wrong-token-0123456789abcdef"), {"Authorization": TOKEN}, bearer(TOKEN[:-1]),
                    {"Authorization": f"Basic {TOKEN}"}):
        status, body, resp_headers = await call(url, headers=headers)
        assert status == 401 and resp_headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(body) == {"error": "unauthorized", "status": 401}  # no detail
    for token in (TOKEN, OTHER):
        status, body, _ = await call(url, headers=bearer(token))
        assert status == 200 and json.loads(body)["cache"] == "miss"
    for path in ("/healthz", "/readyz"):  # open by default: kubelet probes carry no token
        assert (await call(url, "GET", path))[0] == 200
    for path in ("/metrics", "/v1/stats", "/openapi.json", "/v1/profile"):
        assert (await call(url, "GET", path))[0] == 401
        assert (await call(url, "GET", path, headers=bearer(TOKEN)))[0] == 200


async def test_open_paths_are_configurable(start: SimpleNamespace, tmp_path: Path) -> None:
    security = ServerSecurity(tokens=token_file(tmp_path, TOKEN), open_paths=sec.normalise_paths("metrics"))
    _, url = await start.ranker(security)
    assert (await call(url, "GET", "/metrics"))[0] == 200
    assert (await call(url, "GET", "/healthz"))[0] == 401  # not listed: protected
    assert (await call(url))[0] == 401


async def test_token_file_is_reloaded_when_it_changes(start: SimpleNamespace, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sec, "RELOAD_CHECK_S", 0.0)
    tokens = token_file(tmp_path, TOKEN)
    _, url = await start.ranker(ServerSecurity(tokens=tokens))
    assert (await call(url, headers=bearer(TOKEN)))[0] == 200
    (tmp_path / "tokens").write_text(OTHER + "\n# rotated\n")
    assert (await call(url, headers=bearer(OTHER)))[0] == 200
    assert (await call(url, headers=bearer(TOKEN)))[0] == 401
    (tmp_path / "tokens").unlink()  # a Secret mid-swap: the tokens it had stay
    assert (await call(url, headers=bearer(OTHER)))[0] == 200


@pytest.mark.parametrize("content, message", [("", "holds no token"), ("short\n", "at least 16"),
                                              ("has a space in it 0123456789\n", "without spaces")])
def test_bad_token_files_are_user_errors(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "t").write_text(content)
    with pytest.raises(UserError, match=message):
        TokenFile(tmp_path / "t")
    with pytest.raises(UserError, match=r"(?i)no such file"):
        TokenFile(tmp_path / "missing")
    with pytest.raises(UserError, match="is a directory"):
        TokenFile(tmp_path)


async def test_router_authenticates_clients_and_itself_to_rankers(start: SimpleNamespace, tmp_path: Path) -> None:
    ranker_tokens = token_file(tmp_path, RANKER_TOKEN, name="ranker")
    _, r_url = await start.ranker(ServerSecurity(tokens=ranker_tokens))
    _, url = await start.router((r_url,), ServerSecurity(tokens=token_file(tmp_path, TOKEN)),
                                ClientSecurity(token=ranker_tokens))
    assert (await call(url))[0] == 401
    assert (await call(url, headers=bearer(RANKER_TOKEN)))[0] == 401  # the rankers' token is not a client's
    status, body, headers = await call(url, headers=bearer(TOKEN))
    assert status == 200 and headers["X-Grstack-Route"] and len(json.loads(body)["scores"]) == 3
    # A router without the rankers' token: the rankers refuse it, the client gets a 503 (not a 401 of its own).
    _, bad = await start.router((r_url,), ServerSecurity(tokens=token_file(tmp_path, TOKEN)))
    status, body, _ = await call(bad, headers=bearer(TOKEN))
    assert status == 503 and b"refused the router's credentials" in body


# -- TLS -----------------------------------------------------------------------------------------------------
def tls(certs: SimpleNamespace, client_ca: bool = False, **kw: object) -> ServerSecurity:
    return replace(ServerSecurity(ssl_context=sec.server_ssl_context(certs.cert, certs.key,
                                                                     certs.ca if client_ca else None),
                                  client_certs=client_ca), **kw)


async def test_tls_ranker_and_router(start: SimpleNamespace, certs: SimpleNamespace) -> None:
    _, r_url = await start.ranker(tls(certs))
    assert r_url.startswith("https://")
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await call(r_url)  # the system roots do not know the test CA
    assert (await call(r_url, ssl_ctx=client_ssl_context(certs.ca)))[0] == 200
    _, url = await start.router((r_url,), tls(certs), ClientSecurity(ssl_context=client_ssl_context(certs.ca)))
    status, body, _ = await call(url, ssl_ctx=client_ssl_context(certs.ca))
    assert status == 200 and len(json.loads(body)["scores"]) == 3


async def test_server_name_for_rankers_reached_by_ip(start: SimpleNamespace, certs: SimpleNamespace) -> None:
    _, r_url = await start.ranker(tls(certs))
    by_ip = r_url.replace("localhost", "127.0.0.1")
    wrong = ClientSecurity(ssl_context=client_ssl_context(certs.ca), server_name="not-the-ranker")
    _, url = await start.router((by_ip,), client=wrong)
    assert (await call(url))[0] == 503
    named = ClientSecurity(ssl_context=client_ssl_context(certs.ca), server_name="grstack-ranker")
    _, url = await start.router((by_ip,), client=named)
    assert (await call(url))[0] == 200


async def test_mtls_between_router_and_rankers(start: SimpleNamespace, certs: SimpleNamespace) -> None:
    _, r_url = await start.ranker(tls(certs, client_ca=True))
    plain = client_ssl_context(certs.ca)
    assert (await call(r_url, "GET", "/readyz", ssl_ctx=plain))[0] == 200  # probes need no certificate
    status, _, headers = await call(r_url, ssl_ctx=plain)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(aiohttp.ClientError):  # a certificate from another CA fails the handshake
        await call(r_url, ssl_ctx=client_ssl_context(certs.ca, certs.rogue_cert, certs.rogue_key))
    mtls = ClientSecurity(ssl_context=client_ssl_context(certs.ca, certs.client_cert, certs.client_key))
    _, url = await start.router((r_url,), client=mtls)
    assert (await call(url))[0] == 200
    _, no_cert = await start.router((r_url,), client=ClientSecurity(ssl_context=plain))
    assert (await call(no_cert))[0] == 503


def test_bad_tls_files_are_user_errors(certs: SimpleNamespace, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"--tls-key .*no such file"):
        sec.server_ssl_context(certs.cert, str(tmp_path / "nope.key"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(UserError, match="not a PEM certificate"):
        sec.server_ssl_context(str(tmp_path / "junk.pem"), certs.key)
    with pytest.raises(UserError, match="not a PEM certificate"):
        sec.server_ssl_context(certs.cert, certs.client_key)  # a key that does not match
    with pytest.raises(UserError, match=r"--tls-client-ca .*not a PEM CA"):
        sec.server_ssl_context(certs.cert, certs.key, str(tmp_path / "junk.pem"))
    with pytest.raises(UserError, match="go together"):
        client_ssl_context(certs.ca, certs.client_cert, None)


# -- slow and excess connections --------------------------------------------------------------------------------
def _port(url: str) -> int:
    return int(url.rpartition(":")[2])


async def _read_until_closed(port: int, first: bytes, limit_s: float) -> tuple[bytes, bool]:
    """Sends ``first``, then reads until the server closes the connection; (what came, whether it closed
    within ``limit_s``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if first:
        writer.write(first)
        await writer.drain()
    got = b""
    try:
        async with asyncio.timeout(limit_s):
            while chunk := await reader.read(65536):
                got += chunk
        closed = True
    except TimeoutError:
        closed = False
    except ConnectionResetError:
        closed = True
    writer.close()
    return got, closed


HALF_BODY = (b"POST /v1/rank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
             b'{"user_id": "u1", ')


async def test_half_a_body_is_cut_off(start: SimpleNamespace) -> None:
    _, url = await start.ranker(ServerSecurity(body_timeout_s=0.5, header_timeout_s=30))
    got, closed = await _read_until_closed(_port(url), HALF_BODY, limit_s=10)
    assert closed and got.startswith(b"HTTP/1.1 408") and b"request body not received" in got
    assert (await call(url))[0] == 200  # the server goes on serving


async def test_slow_or_missing_headers_are_cut_off(start: SimpleNamespace) -> None:
    _, url = await start.ranker(ServerSecurity(header_timeout_s=0.5))
    got, closed = await _read_until_closed(_port(url), b"POST /v1/rank HTTP/1.1\r\nHost: x\r\n", limit_s=10)
    assert closed and got == b""
    got, closed = await _read_until_closed(_port(url), b"", limit_s=10)  # connects, sends nothing
    assert closed and got == b""


async def test_idle_keepalive_connection_is_closed(start: SimpleNamespace) -> None:
    _, url = await start.ranker(ServerSecurity(idle_timeout_s=0.5, header_timeout_s=30))
    got, closed = await _read_until_closed(_port(url), b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", limit_s=10)
    assert closed and got.startswith(b"HTTP/1.1 200")


async def test_connection_cap(start: SimpleNamespace) -> None:
    _, url = await start.ranker(ServerSecurity(max_connections=3, header_timeout_s=60, idle_timeout_s=60))
    held = [await asyncio.open_connection("127.0.0.1", _port(url)) for _ in range(3)]
    got, closed = await _read_until_closed(_port(url), b"", limit_s=10)
    assert closed and got.startswith(b"HTTP/1.1 503") and b"too many connections" in got
    _, w = held.pop()
    w.close()
    await w.wait_closed()
    for _ in range(100):  # the server sees the close on its next loop iterations
        status = await _status_or_none(url)
        if status == 200:
            break
        await asyncio.sleep(0.05)
    assert status == 200
    for _, w in held:
        w.close()


async def _status_or_none(url: str) -> int | None:
    try:
        return (await call(url, "GET", "/healthz"))[0]
    except aiohttp.ClientError:
        return None


# -- the deadline header ----------------------------------------------------------------------------------------
BAD_DEADLINES = ["nan", "NaN", "inf", "-inf", "Infinity", "-5", "1e3", "abc", "", "5 ms", "0x10", "1_000"]


async def test_bad_deadline_header_is_a_400_naming_it(start: SimpleNamespace) -> None:
    _, r_url = await start.ranker()
    _, url = await start.router((r_url,))
    for target in (r_url, url):
        for raw in BAD_DEADLINES:
            status, body, _ = await call(target, headers={"X-Grstack-Deadline-Ms": raw})
            assert status == 400, (target, raw)
            assert "X-Grstack-Deadline-Ms" in json.loads(body)["error"]
        assert (await call(target, headers={"X-Grstack-Deadline-Ms": "1500.5"}))[0] == 200
    status, _, headers = await call(r_url, headers={"X-Grstack-Deadline-Ms": "0"})
    assert status == 504 and headers["X-Grstack-Shed"] == "deadline"


# -- the command line -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--auth-token-file", "/nonexistent/tokens"], "--auth-token-file /nonexistent/tokens: No such file"),
    (["--tls-cert", "/nonexistent/c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "/nonexistent/ca.pem"], "--tls-client-ca needs --tls-cert"),
    (["--body-timeout-s", "nan"], "--body-timeout-s nan: must be a positive number"),
    (["--header-timeout-s", "0"], "--header-timeout-s 0: must be a positive"),
    (["--max-connections", "0"], "--max-connections 0: must be at least 1"),
])
def test_cli_security_mistakes_are_one_line_errors(tiny_checkpoint: Path, extra: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from grstack.runtime.cli import main

    for argv in (["serve", "ranker", "--checkpoint", str(tiny_checkpoint), *extra],
                 ["serve", "router", "--rankers", "http://127.0.0.1:9", *extra]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_cli_router_client_mistakes(capsys: pytest.CaptureFixture[str]) -> None:
    from grstack.runtime.cli import main

    for extra, message in ((["--ranker-cert", "c.pem", "--ranker-key", "k.pem"], "need --ranker-ca"),
                           (["--ranker-server-name", "r"], "--ranker-server-name needs --ranker-ca"),
                           (["--ranker-ca", "/nonexistent/ca.pem"], "--ranker-ca /nonexistent/ca.pem: no such file"),
                           (["--ranker-token-file", "/nonexistent/t"], "--ranker-token-file /nonexistent/t")):
        assert main(["serve", "router", "--rankers", "http://127.0.0.1:9", *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


async def test_no_spelling_of_a_path_skips_the_token(start: SimpleNamespace, tmp_path: Path) -> None:
    _, url = await start.ranker(ServerSecurity(tokens=token_file(tmp_path, TOKEN)))
    port = _port(url)
    for path in (b"/healthz/../v1/rank", b"/healthz%2F..%2Fv1%2Frank", b"/readyz/..%2Fv1/rank", b"//v1/rank",
                 b"/v1/rank?/healthz", b"/v1/rank#/healthz", b"/HEALTHZ"):
        body = json.dumps(RANK).encode()
        request = (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got, closed = await _read_until_closed(port, request, limit_s=10)
        assert closed and not got.startswith(b"HTTP/1.1 200"), (path, got[:200])
