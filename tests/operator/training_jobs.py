"""The GRTrainingJob the reconcile tests start from, and the clock they read it at."""

from __future__ import annotations

import datetime as dt
from typing import Any

from grstack.operator import names

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
T0 = "2026-01-01T11:00:00Z"  # an hour before NOW


def job(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None,
        generation: int = 1) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND,
            "metadata": {"name": "demo", "namespace": "ns", "uid": "uid-1", "generation": generation},
            "spec": {"image": "grstack:cpu", "workers": {"replicas": 2}, **(spec or {})},
            "status": status or {}}
