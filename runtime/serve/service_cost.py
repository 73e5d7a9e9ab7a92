"""How much a ranker's compute costs in service against its start-up profile: the factor the trigger's risk test
scales the profile by.

A ranker profiles itself once, idle, at start-up; in service the same steps cost more (on a core shared with
the event loop and its neighbours) or less (a warmed device). The
ranker therefore compares its recent single-user steps with what the profile predicts for them and reports the
ratio of the sums in ``GET /v1/stats`` (``service_cost_factor``); the router's trigger multiplies a miss's
profiled time by it (trigger.py, at-risk test). Batched steps are left out (the profile times one user), as are
incremental extends (the profile has no curve for a prefix grown by a few tokens). Each step is predicted at
its own size: a full ranking at its prefix length (its tokens less the profile's short-term and candidate
tokens), a cached ranking at its context, a prefill at its tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from grstack.runtime.serve.step_log import StepRecord
from grstack.runtime.serve.trigger import LatencyModel

SERVICE_COST_STEPS = 256  # the most recent steps looked at
SERVICE_COST_MIN_STEPS = 16  # fewer single-user steps than this among them: no factor (None)
SERVICE_COST_BOUNDS = (0.25, 8.0)  # a factor outside is clipped: one stalled step must not swing the risk test


def profiled_ms(model: LatencyModel, kind: str, tokens: int, context: int, suffix: int) -> float | None:
    """What the start-up profile predicts for one user's step (None: a step it has no curve for)."""
    if kind == "rank_full":
        return model.predict_full_ms(max(tokens - suffix, 1))
    if kind == "rank_cached":
        return model.predict_cached_ms(max(context, 1))
    if kind == "extend_many" and context == 0:
        return model.predict_prefill_ms(tokens)
    return None


def service_cost_factor(steps: Iterable[StepRecord], model: LatencyModel, suffix: int,
                        min_steps: int = SERVICE_COST_MIN_STEPS) -> float | None:
    """Measured over profiled milliseconds of the single-user ``steps`` the profile has a curve for, clipped to
    ``SERVICE_COST_BOUNDS``; None with fewer than ``min_steps`` of them."""
    measured = predicted = 0.0
    n = 0
    for s in steps:
        if s.batch != 1:
            continue
        expected = profiled_ms(model, s.kind, s.tokens, s.context, suffix)
        if expected is None or expected <= 0.0:
            continue
        measured += s.seconds * 1e3
        predicted += expected
        n += 1
    if n < min_steps or predicted <= 0.0:
        return None
    lo, hi = SERVICE_COST_BOUNDS
    return min(hi, max(lo, measured / predicted))
