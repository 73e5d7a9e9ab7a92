"""How the router reaches its rankers: one interface, HTTP in service, in process for tests and simulation.

The router sees a ranker only as a URL it sends requests to and the :class:`Reply` it gets back; it never
touches sockets itself. Failures come as :class:`Unreachable` (nothing answers there: the replica is marked
down), :class:`TransportError` (the exchange broke: a fault for outlier detection) or ``TimeoutError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from grstack.runtime.serve.security import ClientSecurity


class TransportError(Exception):
    """The exchange with a ranker broke (disconnected, bad payload); ``kind`` names the underlying failure."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class Unreachable(TransportError):
    """Nothing accepted the connection: the replica is down, not slow."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not)."""
        return json.loads(self.body)


class RankerTransport(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def post(self, url: str, path: str, body: bytes, timeout_s: float,
                   headers: Mapping[str, str] | None = None) -> Reply:
        """POSTs a JSON ``body`` to ``url + path``; raises ``TimeoutError`` after ``timeout_s``."""
        ...

    async def get(self, url: str, path: str, timeout_s: float) -> Reply: ...


class HttpTransport:
    """aiohttp, one pooled session; ``client``: TLS and the router's token (plain HTTP, no token when None)."""

    def __init__(self, client: ClientSecurity | None = None, limit: int = 512) -> None:
        self.client = client or ClientSecurity()
        self._limit = limit
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._limit, ssl=self.client.connector_ssl()),
            timeout=aiohttp.ClientTimeout(total=None), middlewares=self.client.middlewares())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the transport was not started (Router.start() was not called)"
        return self._session

    async def post(self, url: str, path: str, body: bytes, timeout_s: float,
                   headers: Mapping[str, str] | None = None) -> Reply:
        return await self._call("POST", url + path, timeout_s, body,
                                {"Content-Type": "application/json", **(headers or {})})

    async def get(self, url: str, path: str, timeout_s: float) -> Reply:
        return await self._call("GET", url + path, timeout_s)

    async def _call(self, method: str, url: str, timeout_s: float, body: bytes | None = None,
                    headers: Mapping[str, str] | None = None) -> Reply:
        try:
            async with self._http().request(method, url, data=body, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return Reply(resp.status, await resp.read(), dict(resp.headers))
        except aiohttp.ClientConnectorError as exc:
            raise Unreachable(type(exc).__name__, str(exc)) from exc
        except TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            raise TransportError(type(exc).__name__, str(exc)) from exc
