"""The host-DRAM tier of the prefix cache as an object of its own, so the replicas of one server can share it.

RelayGR keeps evicted prefixes in the *server's* DRAM: any accelerator of the server can promote a prefix
another one computed, and the DRAM budget is the server's, not split per replica. Entries are keyed by user
and versioned by the prefix hash (a content hash, so a version computed by one replica is valid on another
serving the same model); a user has at most one entry, a new version from any replica replaces it. Byte
accounting is exact (the sum of the entries' bytes, the budget enforced oldest first) and TTLs run on the
injected clock. A host copy held in a pooled buffer (:mod:`grstack.runtime.serve.host_pool`) is given back
to its pool when its entry is dropped, expires or is taken for a promotion.

Sharing is in-process: several :class:`grstack.runtime.serve.ranker.RankerService` objects in one process
(one per device) pass the same :class:`DramTier`. Rankers launched as separate processes (``grstack serve
local`` starts one per replica) each keep their own; sharing across processes would need the entries in
shared memory (a ``/dev/shm`` slab with this object's index in a lock-guarded header) and is not built. Used
from one asyncio event loop (the replicas sharing it run on the same loop).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from grstack.runtime.serve.clock import Now, SystemClock
from grstack.runtime.serve.engine import PrefixKV

__all__ = ["DramEntry", "DramTier"]


@dataclass
class DramEntry:
    version: str
    kv: PrefixKV
    nbytes: int
    expires: float


class DramTier:
    """Users' evicted prefixes in host memory: ``capacity_bytes`` at most, each kept ``ttl_s`` after its put."""

    def __init__(self, capacity_bytes: int, ttl_s: float, clock: Now | None = None) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.ttl_s = float(ttl_s)
        self.clock: Now = clock if clock is not None else SystemClock()
        self.used_bytes = 0
        self.expired = 0  # entries dropped at their TTL, by any replica
        self.dropped = 0  # entries dropped for the byte budget (or refused: too large, no TTL)
        self._entries: OrderedDict[str, DramEntry] = OrderedDict()  # put order: also expiry order

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, user: str) -> DramEntry | None:
        """The user's entry when it has not expired (any version), without taking it."""
        e = self._entries.get(user)
        return e if e is not None and e.expires > self.clock() else None

    def put(self, user: str, version: str, kv: PrefixKV, nbytes: int) -> int:
        """Stores ``kv`` (replacing the user's entry); the number of entries dropped for room (this one
        counts when it cannot be kept at all)."""
        self.drop(user)
        if nbytes > self.capacity_bytes or self.ttl_s <= 0:
            kv.release()
            self.dropped += 1
            return 1
        self.expire()
        self._entries[user] = DramEntry(version, kv, nbytes, self.clock() + self.ttl_s)
        self.used_bytes += nbytes
        n = 0
        while self.used_bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._forget(old)
            n += 1
        self.dropped += n
        return n

    def take(self, user: str, version: str) -> DramEntry | None:
        """Removes and returns the user's entry of ``version`` (for a promotion), None when it is not there;
        the caller releases its ``kv`` once the copy to the device is queued."""
        self.expire()
        e = self._entries.get(user)
        if e is None or e.version != version:
            return None
        del self._entries[user]
        self.used_bytes -= e.nbytes
        return e

    def drop(self, user: str) -> None:
        e = self._entries.pop(user, None)
        if e is not None:
            self._forget(e)

    def expire(self) -> int:
        """Drops the entries past their TTL (oldest first); how many."""
        now, n = self.clock(), 0
        while self._entries:
            user, e = next(iter(self._entries.items()))
            if e.expires > now:
                break
            del self._entries[user]
            self._forget(e)
            n += 1
        self.expired += n
        return n

    def _forget(self, e: DramEntry) -> None:
        self.used_bytes -= e.nbytes
        e.kv.release()  # a pooled host buffer goes back to its pool
