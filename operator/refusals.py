"""Writes the API server refused, surfaced on the resource that asked for them (pure: no I/O, no clock).

A refused create or patch of a child (PodSecurity or ResourceQuota 403, an invalid pod spec's 422, ...) will
not fix itself by retrying at once, and the operator's log is not where a job author looks. So each one
becomes condition ``ReplicaFailure`` (reason ``FailedCreate``/``FailedPatch``, message the API's own), a
Warning Event, ``status.lastFailure`` (the API's code, reason and message) and a visible backoff
(``status.retries``, ``status.nextRetryTime``). A pass whose writes all go through clears the backoff and
sets ``ReplicaFailure`` False; ``lastFailure`` stays as the last one seen.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from grstack.operator import objects

CONDITION = "ReplicaFailure"


@dataclass(frozen=True)
class Refusal:
    operation: str  # "create" or "patch"
    kind: str
    name: str
    code: int
    reason: str
    message: str

    @property
    def condition_reason(self) -> str:
        return "FailedCreate" if self.operation == "create" else "FailedPatch"

    def describe(self) -> str:
        verb = "creating" if self.operation == "create" else "updating"
        return f"{verb} {self.kind} {self.name} was refused ({self.code} {self.reason}): {self.message}"


def retries(status: dict[str, Any]) -> int:
    return int(status.get("retries") or 0)


def record(status: dict[str, Any], refusal: Refusal, retry_in: float, now: dt.datetime,
           generation: int | None) -> list[tuple[str, str, str]]:
    """Writes the refusal into ``status`` (one more retry, due in ``retry_in`` seconds); the Events to post."""
    count = retries(status) + 1
    status["retries"] = count
    status["nextRetryTime"] = objects.timestamp(now + dt.timedelta(seconds=retry_in))
    status["lastFailure"] = {"time": objects.timestamp(now), "operation": refusal.operation, "kind": refusal.kind,
                             "name": refusal.name, "code": refusal.code, "reason": refusal.reason,
                             "message": refusal.message}
    text = f"{refusal.describe()} (retry {count} in {retry_in:.0f}s)"
    status["conditions"] = objects.set_condition(status.get("conditions") or [], CONDITION, True,
                                                 refusal.condition_reason, text, now, generation)
    return [("Warning", refusal.condition_reason, refusal.describe())]


def clear(status: dict[str, Any], now: dt.datetime, generation: int | None) -> list[tuple[str, str, str]]:
    """After a pass whose writes all went through: no backoff; ReplicaFailure False if it was True."""
    status.pop("retries", None)
    status.pop("nextRetryTime", None)
    current = objects.condition(status.get("conditions") or [], CONDITION)
    if current is None or current.get("status") != "True":
        return []
    status["conditions"] = objects.set_condition(status.get("conditions") or [], CONDITION, False, "Created",
                                                 "the API server accepted every write", now, generation)
    return [("Normal", "Created", "the API server accepts the writes again")]
