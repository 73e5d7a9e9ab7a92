"""Replica discovery from a headless Service: the addresses its name resolves to are the rankers, registered in
the placement store as they appear and unregistered as they go (so the ranker count is not baked into the
router's arguments)."""

from __future__ import annotations

import asyncio
import logging
import socket

from grstack.runtime.serve.clock import Clock
from grstack.runtime.serve.placement import PlacementStore, Replica

log = logging.getLogger("grstack.runtime.serve.router")  # the router's log, whichever part speaks


class DnsDiscovery:
    """``target``: "HOST:PORT" of the Service; ``scheme``: of the rankers' URLs (http or https)."""

    def __init__(self, target: str, scheme: str, store: PlacementStore, clock: Clock, interval_s: float) -> None:
        self.target = target
        self.scheme = scheme
        self.store = store
        self.clock = clock
        self.interval_s = interval_s
        self.urls: set[str] = set()

    async def resolve(self) -> None:
        """Registers the addresses the Service name resolves to and unregisters those it no longer does
        (a failed lookup changes nothing: a DNS hiccup must not empty the ring)."""
        host, _, port = self.target.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            log.warning("cannot resolve rankers at %s: %s", self.target, exc)
            return
        urls = set()
        for family, *_, sockaddr in infos:
            host_part = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
            urls.add(f"{self.scheme}://{host_part}:{port}")
        for url in sorted(urls - self.urls):
            await self.store.register(Replica(url, url), ttl_s=0)
        for url in sorted(self.urls - urls):
            await self.store.unregister(url)
        self.urls = urls

    async def loop(self) -> None:
        while True:
            await self.clock.sleep(self.interval_s)
            await self.resolve()
