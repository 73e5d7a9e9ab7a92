"""Locking serving down: bearer tokens, TLS (optionally with client certificates), read timeouts, a connection cap.

Everything here is opt-in except the timeouts and the cap, which hold for every ranker and router:

- tokens (``--auth-token-file``): one or more per file, one a line (``#`` comments), re-read when the file
  changes (a Kubernetes Secret mounted as a volume is swapped in place); compared in constant time; a
  request without a valid ``Authorization: Bearer`` token is answered 401 with ``WWW-Authenticate: Bearer``
  and no detail;
- TLS (``--tls-cert``/``--tls-key``), and with ``--tls-client-ca`` a client certificate signed by that CA on
  every protected path (mTLS between routers and rankers); the handshake itself accepts a client without a
  certificate so that kubelet probes of the open paths still work;
- open paths (``--open-paths``, default ``healthz,readyz``): served without token or client certificate;
  ``/metrics`` is protected unless listed (Prometheus sends a token with ``authorization.credentials_file``);
- timeouts: a connection must deliver a request's headers within ``--header-timeout-s`` of its first byte
  (or of being accepted), its body within ``--body-timeout-s`` (else 408 and the connection is closed), and
  an idle keep-alive connection is closed after ``--idle-timeout-s``;
- ``--max-connections``: connections beyond it are answered 503 and closed at once.

The router's client to the rankers (:class:`ClientSecurity`) sends its own token, verifies the rankers'
certificates against ``--ranker-ca`` (optionally as ``--ranker-server-name``, for rankers discovered by IP)
and presents ``--ranker-cert``/``--ranker-key`` to rankers that require client certificates.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler

from grstack.runtime.errors import UserError
from grstack.runtime.serve.security_cli import DEFAULT_OPEN_PATHS

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MIN_TOKEN_CHARS = 16
RELOAD_CHECK_S = 1.0  # how often a token file is looked at for changes (a stat, on the request path)
UNAUTHORIZED = b'{"error":"unauthorized","status":401}'


class TokenFile:
    """The tokens in ``path``, re-read when its modification time, size or inode changes (checked at most every
    ``RELOAD_CHECK_S``). A file that cannot be read, or holds no token, at start-up is a ``UserError``; later
    it keeps the tokens it had (a Secret being swapped is briefly absent) and logs a warning."""

    def __init__(self, path: str | Path, flag: str = "--auth-token-file") -> None:
        self.path, self.flag = Path(path), flag
        self._stamp: tuple[int, int, int] | None = None
        self._checked = 0.0
        self._tokens = self._load()

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _load(self) -> tuple[bytes, ...]:
        try:
            stamp = self._stat()
            text = self.path.read_text(encoding="utf-8")
        except IsADirectoryError:
            raise UserError(f"{self.flag} {self.path}: is a directory, not a file of tokens") from None
        except OSError as exc:
            raise UserError(f"{self.flag} {self.path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise UserError(f"{self.flag} {self.path}: not a UTF-8 text file of tokens") from None
        tokens = []
        for n, line in enumerate(text.splitlines(), 1):
            tok = line.strip()
            if not tok or tok.startswith("#"):
                continue
            if len(tok) < MIN_TOKEN_CHARS or not tok.isascii() or any(c.isspace() or not c.isprintable() for c in tok):
                raise UserError(f"{self.flag} {self.path}: line {n}: a token is at least {MIN_TOKEN_CHARS} "
                                f"printable ASCII characters without spaces (e.g. `openssl rand -hex 32`)")
            tokens.append(tok.encode())
        if not tokens:
            raise UserError(f"{self.flag} {self.path}: holds no token (one a line; # starts a comment)")
        self._stamp = stamp
        return tuple(tokens)

    def tokens(self) -> tuple[bytes, ...]:
        now = time.monotonic()
        if now - self._checked >= RELOAD_CHECK_S:
            self._checked = now
            try:
                changed = self._stat() != self._stamp
            except OSError:
                changed = False  # mid-swap: keep the tokens we have
            if changed:
                try:
                    self._tokens = self._load()
                    log.info("reloaded %d token(s) from %s", len(self._tokens), self.path)
                except UserError as exc:
                    log.warning("keeping the previous tokens: %s", exc)
        return self._tokens

    def first(self) -> str:
        """The token a client sends (the file's first)."""
        return self.tokens()[0].decode()

    def accepts(self, presented: str) -> bool:
        """Constant time in the token's content: every configured token is compared, whichever matches."""
        given = presented.encode("utf-8", "surrogateescape")
        ok = False
        for tok in self.tokens():
            ok |= hmac.compare_digest(tok, given)
        return ok


def normalise_paths(paths: str | tuple[str, ...] | list[str]) -> frozenset[str]:
    items = paths.split(",") if isinstance(paths, str) else list(paths)
    return frozenset("/" + p.strip().strip("/") for p in items if p.strip().strip("/"))


@dataclass
class ServerSecurity:
    """What a ranker or router enforces. The defaults lock nothing but still bound slow and idle clients."""

    tokens: TokenFile | None = None
    open_paths: frozenset[str] = field(default_factory=lambda: normalise_paths(DEFAULT_OPEN_PATHS))
    ssl_context: ssl.SSLContext | None = None
    client_certs: bool = False  # --tls-client-ca: protected paths need a verified client certificate
    header_timeout_s: float = 5.0
    body_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    max_connections: int = 4096

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    def is_open(self, route: str | None) -> bool:
        return route is not None and route in self.open_paths


def server_ssl_context(cert: str | None, key: str | None, client_ca: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cert, key, "--tls-cert", "--tls-key")
    if client_ca:
        _load_ca(ctx, client_ca, "--tls-client-ca")
        # Optional at the handshake, required by the guard on protected paths: probes reach the open ones.
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_ssl_context(ca: str | None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca:
        _load_ca(ctx, ca, "--ranker-ca")
    if cert or key:
        _load_chain(ctx, cert, key, "--ranker-cert", "--ranker-key")
    return ctx


def _readable(path: str | None, flag: str) -> str:
    if not path:
        raise UserError(f"{flag} is required here")
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {path}: is a directory, not a PEM file")
    if not os.access(p, os.R_OK):
        raise UserError(f"{flag} {path}: {'not readable' if p.exists() else 'no such file'}")
    return path


def _load_chain(ctx: ssl.SSLContext, cert: str | None, key: str | None, cert_flag: str, key_flag: str) -> None:
    if bool(cert) != bool(key):
        raise UserError(f"{cert_flag} and {key_flag} go together (a certificate and its private key)")
    try:
        ctx.load_cert_chain(_readable(cert, cert_flag), _readable(key, key_flag))
    except ssl.SSLError as exc:
        raise UserError(f"{cert_flag} {cert} / {key_flag} {key}: not a PEM certificate and matching private key "
                        f"({exc.reason or exc})") from None


def _load_ca(ctx: ssl.SSLContext, ca: str, flag: str) -> None:
    try:
        ctx.load_verify_locations(cafile=_readable(ca, flag))
    except ssl.SSLError as exc:
        raise UserError(f"{flag} {ca}: not a PEM CA bundle ({exc.reason or exc})") from None


# -- the request guard ------------------------------------------------------------------------------------
def _unauthorized(request: web.Request) -> web.Response:
    resp = web.Response(status=401, body=UNAUTHORIZED, content_type="application/json",
                        headers={"WWW-Authenticate": "Bearer"})
    if request.body_exists:
        resp.force_close()  # an unauthenticated body is not read
    return resp


def _has_client_cert(request: web.Request) -> bool:
    transport = request.transport
    return bool(transport is not None and transport.get_extra_info("peercert"))


def _route(request: web.Request) -> str | None:
    """The path of the route that will handle the request (None: no route matched). The open paths are
    checked against it, not against the raw path, so no spelling of a path reaches a protected handler."""
    info = request.match_info
    resource = getattr(getattr(info, "route", None), "resource", None)
    if resource is None or getattr(info, "http_exception", None) is not None:
        return None
    return str(resource.canonical)


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def guard(security: ServerSecurity) -> Middleware:
    """aiohttp middleware: marks the request's headers as read (the header timeout stops), checks the token
    and client certificate on protected paths, then reads the body within the body timeout (408 and the
    connection closed when it does not arrive)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        proto = request.protocol
        if isinstance(proto, GuardedHandler):
            proto.request_started()
        try:
            if not security.is_open(_route(request)):
                if security.client_certs and not _has_client_cert(request):
                    return _unauthorized(request)
                if security.tokens is not None:
                    token = _bearer(request)
                    if token is None or not security.tokens.accepts(token):
                        return _unauthorized(request)
            if request.body_exists:
                try:
                    async with asyncio.timeout(security.body_timeout_s):
                        await request.read()  # cached: handlers read it again for free
                except TimeoutError:
                    resp = web.json_response({"error": f"request body not received within "
                                                       f"{security.body_timeout_s:g} s", "status": 408}, status=408)
                    resp.force_close()
                    return resp
            return await handler(request)
        finally:
            if isinstance(proto, GuardedHandler):
                proto.request_finished()

    return middleware


# -- the connection layer: header timeout and connection cap -------------------------------------------------
class ConnectionCounter:
    def __init__(self, limit: int) -> None:
        self.limit, self.active, self.refused = limit, 0, 0


def fd_room(reserve: int = 64) -> int | None:
    """File descriptors this process may still open for connections (the soft RLIMIT_NOFILE less a reserve for
    models, logs and the router's own client sockets); None when unlimited or unknown."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else max(1, soft - reserve)


_REFUSED_BODY = b'{"error":"too many connections","status":503}'
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n" + _REFUSED_BODY)


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with a header timeout (from the first byte of a request, or from accept) and a
    connection cap (beyond it: 503 and close)."""

    def __init__(self, manager: Any, *, counter: ConnectionCounter, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._counter, self._header_timeout_s = counter, header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._busy = False
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._counter.active >= self._counter.limit:
            self._refused = True
            self._counter.refused += 1
            assert isinstance(transport, asyncio.Transport)
            transport.write(_REFUSED)
            transport.close()
            return
        self._counter.active += 1
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._counter.active -= 1
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._busy and self._header_timer is None:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)

    def request_started(self) -> None:
        self._busy = True
        self._disarm()

    def request_finished(self) -> None:
        self._busy = False

    def _arm(self) -> None:
        if self._header_timeout_s > 0:
            self._header_timer = asyncio.get_running_loop().call_later(self._header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self._busy:
            self.force_close()


class GuardedSite(web.TCPSite):
    """A TCPSite whose connections are :class:`GuardedHandler`\\ s (TLS handshakes bounded by the header
    timeout too)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, security: ServerSecurity) -> None:
        super().__init__(runner, host, port, ssl_context=security.ssl_context, reuse_address=True)
        self.security = security
        limit, room = security.max_connections, fd_room()
        if room is not None and room < limit:
            # Past the descriptor limit accept() fails and asyncio stops accepting for a second: refuse first.
            log.warning("--max-connections %d exceeds what the open-files limit (ulimit -n) leaves; capping at %d",
                        limit, room)
            limit = room
        self.counter = ConnectionCounter(limit)

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        sec = self.security
        kwargs = {**server._kwargs, "keepalive_timeout": sec.idle_timeout_s, "lingering_time": sec.body_timeout_s}

        def factory() -> GuardedHandler:
            return GuardedHandler(server, loop=loop, counter=self.counter, header_timeout_s=sec.header_timeout_s,
                                  **kwargs)

        extra: dict[str, Any] = {}
        if sec.ssl_context is not None and sec.header_timeout_s > 0:
            extra["ssl_handshake_timeout"] = sec.header_timeout_s
        self._server = await loop.create_server(factory, self._host, self._port, ssl=sec.ssl_context,
                                                backlog=self._backlog, reuse_address=True, **extra)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


# -- the router's client to the rankers ------------------------------------------------------------------------
@dataclass
class ClientSecurity:
    """How the router reaches rankers: TLS (CA, optional client certificate, the name their certificates carry)
    and the token it sends."""

    ssl_context: ssl.SSLContext | None = None
    token: TokenFile | None = None
    server_name: str | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    def connector_ssl(self) -> ssl.SSLContext | bool:
        return self.ssl_context if self.ssl_context is not None else True

    def middlewares(self) -> tuple[Any, ...]:
        token, name = self.token, self.server_name
        if token is None and name is None:
            return ()

        async def mw(req: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
            if token is not None:
                req.headers["Authorization"] = f"Bearer {token.first()}"
            if name is not None and req.url.scheme == "https":
                req.server_hostname = name
            return await handler(req)

        return (mw,)
