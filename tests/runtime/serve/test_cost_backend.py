"""The simulator's compute backend charges what the profile says for the sizes the real scheduler logs, and
reads a prefix warm only in the ranking right after the extend that computed it (the chunk step's), as the
real step log counts it: any other ranking reads its context from the cache (``cold``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from grstack.runtime.serve.cost_backend import CostBackend
from grstack.runtime.serve.cost_profile import STEP_FEATURES, CostModel, CostProfile
from grstack.runtime.serve.engine import RelayEngine

pytestmark = pytest.mark.unit

CONST, PER_CONTEXT, PER_COLD = 1e-3, 1e-6, 4e-6


def profile() -> CostProfile:
    coef = {"step": CONST, "context": PER_CONTEXT, "cold": PER_COLD}
    model = CostModel(STEP_FEATURES, tuple(coef.get(f, 0.0) for f in STEP_FEATURES))
    return CostProfile(source="model", host={}, model={}, steps={"rank_cached": model, "extend_many": model,
                                                                 "rank_full": model})


def test_a_ranking_reads_cold_context_unless_it_follows_the_extend_that_computed_it(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    charged: list[float] = []
    backend = CostBackend(eng, profile(), charged.append, tails=False)
    rng = np.random.default_rng(0)
    n = 20
    items, ts = rng.integers(1, 300, n), 1_600_000_000 + np.cumsum(rng.integers(1, 999, n))
    req = eng.canonical(items[:16], ts[:16], items[16:], ts[16:], rng.integers(1, 300, 3), int(ts[-1]))
    (kv,) = backend.extend_many([backend.empty_prefix()], [items[:16]], [ts[:16]])
    assert charged[-1] == pytest.approx(CONST)  # an extend from nothing: no context
    backend.rank_cached([kv], [req])  # the chunk step's ranking: warm
    assert charged[-1] == pytest.approx(CONST + PER_CONTEXT * 16)
    backend.rank_cached([kv], [req])  # later, a hit on the cached prefix: cold
    assert charged[-1] == pytest.approx(CONST + (PER_CONTEXT + PER_COLD) * 16)
    (kv2,) = backend.extend_many([kv], [items[16:]], [ts[16:]])
    backend.rank_full([req])
    backend.rank_cached([kv2], [req])  # another call came between: cold
    assert charged[-1] == pytest.approx(CONST + (PER_CONTEXT + PER_COLD) * 20)
