"""The placement store on etcd (aetcd, the maintained asyncio fork of python-etcd3).

Layout under ``root`` (default ``/grstack/ranking/default``)::

    {root}/replicas/{replica_id}  = {"id", "url"}         attached to the replica's lease
    {root}/placements/{user}      = {"replica", "version"}  attached to the replica's lease, or to a TTL lease

A placement is written in one transaction that checks the replica is still the same registration (its
key's create revision) and that the placement key is unchanged (absent, or at the expected mod revision):
compare-and-swap. Without a TTL a placement shares its replica's lease, so a crashed replica's placements
vanish with it. With a TTL it is attached to a lease shared by every placement written in the same slice of
time (a lease per user would make etcd keep and expire one lease per user): granted for ``ttl + slack``
and used for ``slack`` seconds (a tenth of the TTL, at least 1 s), so a placement expires between ``ttl``
and ``ttl + slack`` after its last write. Every call has a deadline; a lost etcd surfaces as
:class:`StoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aetcd
import aetcd.client
import aetcd.exceptions
import aetcd.rpc
import grpc

from grstack.runtime.errors import UserError
from grstack.runtime.serve.placement import Event, Placement, PlacementStore, Replica, StoreUnavailable

log = logging.getLogger(__name__)


async def bounded(coro: Any, timeout_s: float) -> Any:
    """Like ``asyncio.wait_for``, but returns at the deadline even if the call ignores cancellation (grpc
    calls on a dead channel can), instead of waiting for it to wind down."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise TimeoutError(f"no answer within {timeout_s} s")
    return task.result()


def parse_etcd_url(url: str) -> tuple[str, int]:
    u = urlparse(url if "://" in url else f"http://{url}")
    if not u.hostname:
        raise ValueError(f"etcd URL {url!r} has no host; expected e.g. http://127.0.0.1:2379")
    return u.hostname, u.port or 2379


PASSWORD_ENV = "GRSTACK_ETCD_PASSWORD"


@dataclass(frozen=True)
class EtcdAuth:
    """TLS and authentication for the etcd client. TLS is on when the URL is ``https://`` or any of ``ca_cert``,
    ``cert``, ``key`` is given (server verified against ``ca_cert``, else the system roots; ``cert`` + ``key``
    for client-certificate auth). ``user`` + ``password``: etcd's password auth (a token fetched on connect)."""

    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    @property
    def tls_files(self) -> bool:
        return any((self.ca_cert, self.cert, self.key))

    def validate(self) -> None:
        """Raises :class:`UserError` naming the option for a missing or unreadable file or a half-given pair."""
        if bool(self.cert) != bool(self.key):
            raise UserError("etcd client certificate needs both --etcd-cert and --etcd-key")
        if bool(self.user) != (self.password is not None):
            raise UserError(f"etcd auth needs both --etcd-user and a password (--etcd-password-file or "
                            f"${PASSWORD_ENV})")
        for flag, path in (("--etcd-ca", self.ca_cert), ("--etcd-cert", self.cert), ("--etcd-key", self.key)):
            if path and not os.access(path, os.R_OK):
                why = "does not exist" if not Path(path).exists() else "is not readable"
                raise UserError(f"{flag} {path} {why}")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca_cert), read(self.key), read(self.cert))


class _Client(aetcd.Client):
    """aetcd's client with an optional TLS channel (aetcd 1.x only opens insecure channels)."""

    def __init__(self, *args: Any, credentials: grpc.ChannelCredentials | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    @aetcd.client._handle_errors
    async def connect(self) -> None:
        if self._credentials is None:
            return await aetcd.Client.connect.__wrapped__(self)
        real = aetcd.rpc.insecure_channel
        creds = self._credentials

        def secure(target: str, options: Any = None) -> Any:
            aetcd.rpc.insecure_channel = real
            return aetcd.rpc.secure_channel(target, creds, options=options)

        # aetcd.Client.connect opens its channel with rpc.insecure_channel(target, options=...) before its first
        # await, then sets up auth and stubs; for TLS the same steps run with a secure channel in its place.
        # The swap is undone on that call (and in ``finally``), so no other coroutine ever sees it.
        aetcd.rpc.insecure_channel = secure
        try:
            await aetcd.Client.connect.__wrapped__(self)
        finally:
            aetcd.rpc.insecure_channel = real


class EtcdPlacementStore(PlacementStore):
    def __init__(self, url: str, root: str = "/grstack/ranking/default", timeout_s: float = 2.0,
                 auth: EtcdAuth | None = None) -> None:
        host, port = parse_etcd_url(url)
        auth = auth or EtcdAuth()
        auth.validate()
        self.url = url
        self.root = root.rstrip("/")
        self.timeout_s = timeout_s
        tls = auth.tls_files or url.startswith("https://")
        self._client = _Client(host=host, port=port, timeout=timeout_s, username=auth.user,
                               password=auth.password, credentials=auth.credentials() if tls else None)
        self._keepalive: dict[str, asyncio.Task[None]] = {}
        self._ttl_leases: dict[float, tuple[int, float]] = {}  # placement TTL -> (lease id, monotonic grant time)

    # -- keys ---------------------------------------------------------------------------------------
    def _rkey(self, rid: str) -> bytes:
        return f"{self.root}/replicas/{rid}".encode()

    def _pkey(self, user: str) -> bytes:
        return f"{self.root}/placements/{user}".encode()

    async def _call(self, coro: Any) -> Any:
        try:
            return await bounded(coro, self.timeout_s)
        except (TimeoutError, aetcd.exceptions.ClientError, OSError) as exc:
            raise StoreUnavailable(f"etcd {self.url}: {type(exc).__name__}: {exc}") from exc

    # -- replicas -----------------------------------------------------------------------------------
    async def _put_replica(self, replica: Replica, ttl_s: float) -> int:
        lease = await self._call(self._client.lease(max(1, round(ttl_s))))
        value = json.dumps({"id": replica.id, "url": replica.url}).encode()
        await self._call(self._client.put(self._rkey(replica.id), value, lease=lease))
        return lease.id

    async def register(self, replica: Replica, ttl_s: float) -> None:
        """Registers now if etcd answers, else keeps trying in the background (a ranker serves either way)."""
        try:
            lease_id: int | None = await self._put_replica(replica, ttl_s)
        except StoreUnavailable as exc:
            log.warning("could not register replica %s in etcd yet (%s); retrying", replica.id, exc)
            lease_id = None
        old = self._keepalive.pop(replica.id, None)
        if old is not None:
            old.cancel()
        self._keepalive[replica.id] = asyncio.get_running_loop().create_task(
            self._keep(replica, ttl_s, lease_id))

    async def _keep(self, replica: Replica, ttl_s: float, lease_id: int | None) -> None:
        """Refreshes the lease every ttl/3; (re-)registers when there is none or it was lost."""
        while True:
            await asyncio.sleep(max(ttl_s / 3, 0.1) if lease_id is not None else 0.5)
            try:
                reply = await self._call(self._client.refresh_lease(lease_id)) if lease_id is not None else None
                if reply is None or reply.TTL <= 0:
                    lease_id = await self._put_replica(replica, ttl_s)
                    log.info("registered replica %s in etcd", replica.id)
            except StoreUnavailable as exc:
                log.debug("lease keep-alive for %s failed: %s", replica.id, exc)

    def stop_keepalive(self, replica_id: str) -> None:
        task = self._keepalive.pop(replica_id, None)
        if task is not None:
            task.cancel()

    async def unregister(self, replica_id: str) -> None:
        self.stop_keepalive(replica_id)
        got = await self._call(self._client.get(self._rkey(replica_id)))
        if got is not None and got.lease:
            await self._call(self._client.revoke_lease(got.lease))

    def _replica_of(self, kv: Any) -> Replica:
        d = json.loads(kv.value)
        return Replica(d["id"], d["url"], kv.lease)

    def _placement_of(self, user: str, kv: Any) -> Placement:
        d = json.loads(kv.value)
        return Placement(user, d["replica"], d.get("version", ""), kv.mod_revision)

    async def replicas(self) -> dict[str, Replica]:
        rng = await self._call(self._client.get_prefix(f"{self.root}/replicas/".encode()))
        return {r.id: r for r in (self._replica_of(kv) for kv in rng)}

    # -- placements ---------------------------------------------------------------------------------
    async def get_placement(self, user: str) -> Placement | None:
        kv = await self._call(self._client.get(self._pkey(user)))
        return self._placement_of(user, kv) if kv is not None else None

    async def _ttl_lease(self, ttl_s: float, fresh: bool = False) -> int:
        """The shared lease for placements written now with ``ttl_s`` (granted anew every ``slack`` seconds)."""
        slack = max(1.0, ttl_s / 10)
        now = time.monotonic()
        cur = self._ttl_leases.get(ttl_s)
        if cur is None or fresh or now - cur[1] >= slack:
            lease = await self._call(self._client.lease(max(2, math.ceil(ttl_s + slack))))
            cur = self._ttl_leases[ttl_s] = (lease.id, now)
        return cur[0]

    async def cas_placement(self, user: str, replica_id: str, version: str, expected: Placement | None,
                            ttl_s: float | None = None) -> Placement | None:
        rep = await self._call(self._client.get(self._rkey(replica_id)))
        if rep is None:
            return None
        t = self._client.transactions
        pkey = self._pkey(user)
        cond = t.version(pkey) == 0 if expected is None else t.mod(pkey) == expected.revision
        value = json.dumps({"replica": replica_id, "version": version}).encode()
        for attempt in range(2):
            lease = rep.lease if ttl_s is None else await self._ttl_lease(ttl_s, fresh=attempt > 0)
            try:
                ok, responses = await self._call(self._client.transaction(
                    compare=[t.create(self._rkey(replica_id)) == rep.create_revision, cond],
                    success=[t.put(pkey, value, lease=lease)], failure=[]))
            except StoreUnavailable as exc:
                if "lease not found" not in str(exc):
                    raise
                if ttl_s is None:  # the replica's lease expired between the two calls
                    return None
                continue  # the shared TTL lease is gone (etcd lost its data): grant a new one
            if not ok:
                return None
            return Placement(user, replica_id, version, responses[0].response_put.header.revision)
        return None

    async def delete_placement(self, user: str, expected: Placement) -> bool:
        t = self._client.transactions
        pkey = self._pkey(user)
        ok, _ = await self._call(self._client.transaction(compare=[t.mod(pkey) == expected.revision],
                                                          success=[t.delete(pkey)], failure=[]))
        return bool(ok)

    # -- watch --------------------------------------------------------------------------------------
    async def watch(self) -> AsyncIterator[Event]:
        prefix = f"{self.root}/"
        rng = await self._call(self._client.get_prefix(prefix.encode()))
        replicas, placements = [], []
        for kv in rng:
            kind, name = self._classify(kv.key, prefix)
            if kind == "replicas":
                replicas.append(self._replica_of(kv))
            elif kind == "placements":
                placements.append(self._placement_of(name, kv))
        yield Event("snapshot", replicas=tuple(replicas), placements=tuple(placements))
        try:
            w = await self._call(self._client.watch_prefix(prefix.encode(),
                                                           start_revision=rng.header.revision + 1))
        except StoreUnavailable:
            raise
        try:
            async for ev in w:
                kind, name = self._classify(ev.kv.key, prefix)
                put = ev.kind == "PUT"
                if kind == "replicas":
                    yield Event("replica", replica=self._replica_of(ev.kv)) if put else Event(
                        "replica-gone", key=name)
                elif kind == "placements":
                    yield Event("placement", placement=self._placement_of(name, ev.kv)) if put else Event(
                        "placement-gone", key=name)
        except (aetcd.exceptions.ClientError, OSError) as exc:
            raise StoreUnavailable(f"etcd {self.url}: watch lost: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                await bounded(w.cancel(), self.timeout_s)
        raise StoreUnavailable(f"etcd {self.url}: watch ended")

    @staticmethod
    def _classify(key: bytes, prefix: str) -> tuple[str, str]:
        rest = key.decode()[len(prefix):]
        kind, _, name = rest.partition("/")
        return kind, name

    async def close(self) -> None:
        for task in self._keepalive.values():
            task.cancel()
        self._keepalive.clear()
        with contextlib.suppress(Exception):
            await bounded(self._client.close(), self.timeout_s)
