"""Relay-race ranking service (docs/architecture.md §5): ranker replicas with a prefix KV cache, and a
router.

Modules: ``engine`` (relay inference on HSTU), ``cache`` (device LRU + DRAM expander), ``scheduler``
(batched compute loop), ``ranker`` / ``router`` (HTTP services), ``trigger`` (sequence-aware trigger),
``ring`` (consistent hashing with bounded load), ``placement`` / ``etcd_store`` (placement stores),
``local`` (router + ranker processes on one machine), ``loadgen`` (open-loop load), ``demo``; the seams
a simulation replaces: ``clock`` (injected time), ``transport`` / ``transport_local`` (how the router reaches
rankers), ``backend`` (the tensor math the compute loop calls); and what it replays: ``step_log`` (the steps and
request CPU a ranker logs in service), ``cost_profile`` (cost models fitted to them, with their tails) and
``cost_paper_scale`` (the 0.2B HSTU on an H200, as a model).

Other packages import from here, never a submodule: the model artefact's loaders, ``RelayEngine``,
``KVArena``, the router (``Router``, ``RouterConfig``, ``start_router``, ``TriggerConfig``), ``spawn_ranker``, the load
generator, ``serve_demo``, and the seams (``Clock``, ``SystemClock``, ``ManualClock``, ``ComputeBackend``,
``RankerTransport``, ``HttpTransport``, ``InProcessTransport``), and the cost profiles (``CostProfile``,
``CostModel``, ``fit_steps``, ``fit_requests``, ``fit_hops``, ``PaperScale``, ``paper_scale_profile``,
``with_host_costs``), and what the simulator builds a deployment from (``CostBackend``, ``RankerService``,
``ranker_config_from_flags``, the virtual-time parts ``VirtualClock``, ``VirtualComputeRunner``, ``CoreSet``,
``run_virtual``, and the request models). Exports load lazily, so importing this package (as ``grstack --help`` does,
through ``serve.cli``) stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grstack.runtime.serve.artifact import load_ranking_model, load_serving_model, write_untrained_model
    from grstack.runtime.serve.backend import ComputeBackend
    from grstack.runtime.serve.cli import ranker_config_from_flags
    from grstack.runtime.serve.clock import Clock, ManualClock, SystemClock
    from grstack.runtime.serve.cost_backend import CostBackend
    from grstack.runtime.serve.cost_paper_scale import PaperScale, paper_scale_profile, with_host_costs
    from grstack.runtime.serve.cost_profile import CostModel, CostProfile, fit_hops, fit_requests, fit_steps
    from grstack.runtime.serve.demo import serve_demo
    from grstack.runtime.serve.dram_tier import DramTier
    from grstack.runtime.serve.engine import RelayEngine
    from grstack.runtime.serve.gc_pauses import frozen_heap, recorded_gc_pauses
    from grstack.runtime.serve.http import RequestError
    from grstack.runtime.serve.kv_arena import KVArena
    from grstack.runtime.serve.loadgen import (
        GiveUp,
        Request,
        Result,
        latency_summary,
        poisson_times,
        run_open_loop,
        violations_to_fail,
    )
    from grstack.runtime.serve.local import spawn_ranker
    from grstack.runtime.serve.ranker import RankerService
    from grstack.runtime.serve.router import Router, RouterConfig, start_router
    from grstack.runtime.serve.schemas import Events, PrefillRequest, RankRequest
    from grstack.runtime.serve.step_log import attention_pairs
    from grstack.runtime.serve.transport import HttpTransport, RankerTransport
    from grstack.runtime.serve.transport_local import InProcessTransport
    from grstack.runtime.serve.trigger import TriggerConfig
    from grstack.runtime.serve.virtual_time import (
        CoreSet,
        SharedCores,
        VirtualClock,
        VirtualComputeRunner,
        run_virtual,
    )

_EXPORTS = {
    "load_ranking_model": "grstack.runtime.serve.artifact",
    "load_serving_model": "grstack.runtime.serve.artifact",
    "write_untrained_model": "grstack.runtime.serve.artifact",
    "ComputeBackend": "grstack.runtime.serve.backend",
    "Clock": "grstack.runtime.serve.clock",
    "ManualClock": "grstack.runtime.serve.clock",
    "SystemClock": "grstack.runtime.serve.clock",
    "HttpTransport": "grstack.runtime.serve.transport",
    "PaperScale": "grstack.runtime.serve.cost_paper_scale",
    "paper_scale_profile": "grstack.runtime.serve.cost_paper_scale",
    "with_host_costs": "grstack.runtime.serve.cost_paper_scale",
    "CostModel": "grstack.runtime.serve.cost_profile",
    "CostProfile": "grstack.runtime.serve.cost_profile",
    "fit_hops": "grstack.runtime.serve.cost_profile",
    "fit_requests": "grstack.runtime.serve.cost_profile",
    "fit_steps": "grstack.runtime.serve.cost_profile",
    "RankerTransport": "grstack.runtime.serve.transport",
    "InProcessTransport": "grstack.runtime.serve.transport_local",
    "serve_demo": "grstack.runtime.serve.demo",
    "DramTier": "grstack.runtime.serve.dram_tier",
    "RelayEngine": "grstack.runtime.serve.engine",
    "frozen_heap": "grstack.runtime.serve.gc_pauses",
    "recorded_gc_pauses": "grstack.runtime.serve.gc_pauses",
    "KVArena": "grstack.runtime.serve.kv_arena",
    "GiveUp": "grstack.runtime.serve.loadgen",
    "Request": "grstack.runtime.serve.loadgen",
    "latency_summary": "grstack.runtime.serve.loadgen",
    "poisson_times": "grstack.runtime.serve.loadgen",
    "run_open_loop": "grstack.runtime.serve.loadgen",
    "violations_to_fail": "grstack.runtime.serve.loadgen",
    "spawn_ranker": "grstack.runtime.serve.local",
    "Router": "grstack.runtime.serve.router",
    "RouterConfig": "grstack.runtime.serve.router",
    "start_router": "grstack.runtime.serve.router",
    "TriggerConfig": "grstack.runtime.serve.trigger",
    "CostBackend": "grstack.runtime.serve.cost_backend",
    "CoreSet": "grstack.runtime.serve.virtual_time",
    "SharedCores": "grstack.runtime.serve.virtual_time",
    "VirtualClock": "grstack.runtime.serve.virtual_time",
    "VirtualComputeRunner": "grstack.runtime.serve.virtual_time",
    "run_virtual": "grstack.runtime.serve.virtual_time",
    "RankerService": "grstack.runtime.serve.ranker",
    "Result": "grstack.runtime.serve.loadgen",
    "RequestError": "grstack.runtime.serve.http",
    "Events": "grstack.runtime.serve.schemas",
    "PrefillRequest": "grstack.runtime.serve.schemas",
    "RankRequest": "grstack.runtime.serve.schemas",
    "attention_pairs": "grstack.runtime.serve.step_log",
    "ranker_config_from_flags": "grstack.runtime.serve.cli",
}

__all__ = [
    "Clock",
    "ComputeBackend",
    "CoreSet",
    "CostBackend",
    "CostModel",
    "CostProfile",
    "DramTier",
    "Events",
    "GiveUp",
    "HttpTransport",
    "InProcessTransport",
    "KVArena",
    "ManualClock",
    "PaperScale",
    "PrefillRequest",
    "RankRequest",
    "RankerService",
    "RankerTransport",
    "RelayEngine",
    "Request",
    "RequestError",
    "Result",
    "Router",
    "RouterConfig",
    "SharedCores",
    "SystemClock",
    "TriggerConfig",
    "VirtualClock",
    "VirtualComputeRunner",
    "attention_pairs",
    "fit_hops",
    "fit_requests",
    "fit_steps",
    "frozen_heap",
    "latency_summary",
    "load_ranking_model",
    "load_serving_model",
    "paper_scale_profile",
    "poisson_times",
    "ranker_config_from_flags",
    "recorded_gc_pauses",
    "run_open_loop",
    "run_virtual",
    "serve_demo",
    "spawn_ranker",
    "start_router",
    "violations_to_fail",
    "with_host_costs",
    "write_untrained_model",
]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
