"""Cost profiles: what each kind of serving work costs, as a fitted model plus the spread around it.

A simulator that replays the real control plane on virtual time replaces only the tensor math (and the host
work around it) by these costs, so they must hold in service, tails included: a profile keeps, per kind, the
distribution of the relative residual (measured / predicted - 1) at fixed quantile levels, and
:meth:`CostModel.draw` samples from it by inverting that distribution.

Form. A step costs ``c_step + c_batch·batch + c_tokens·tokens + c_context·context + c_pairs·pairs + c_cold·cold`` seconds
(runtime/serve/step_log.py defines the sizes), all coefficients non-negative: a transformer step's FLOPs are
linear in the new tokens (projections) and in the attention pairs, its bytes linear in the cached context
read (K/V) plus a per-step constant (the weights, kernel launches), and the host work of a batch linear in
its users. A sum of non-negative terms is the no-overlap (upper) side of a roofline and extrapolates
monotonically, which a simulator sweeping lengths beyond the calibration needs; a free least-squares fit
could go negative there. It is fitted by non-negative least squares on the relative error (each step
weighted by 1/seconds): steps span three orders of magnitude and stalls scale a step by a factor, so every
step counts by its relative miss and the residuals are multiplicative. A request's CPU outside the steps
(parse, encode, reply) and the router/harness hops use the same machinery with their own features.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

PROFILE_VERSION = 1
# ``cold``: context tokens a ranking reads from the cache rather than right after the step that computed them
# (on a CPU host they come from memory, not its caches: the same sizes cost more; 0 for the other kinds)
STEP_FEATURES = ("step", "batch", "tokens", "context", "pairs", "cold")
REQUEST_FEATURES = ("request", "events", "candidates")
HOP_FEATURES = ("hop",)
LEVELS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)
SOURCES = ("calibrated", "model")


@dataclass(frozen=True)
class CostModel:
    """``seconds = Σ coef[i]·x[features[i]]`` (the first feature is the constant 1), times ``1 + r`` with ``r``
    the relative residual, whose quantiles at :data:`LEVELS` are ``residuals``."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    residuals: tuple[float, ...] = tuple(0.0 for _ in LEVELS)
    samples: int = 0

    def predict(self, sizes: Mapping[str, float] | None = None) -> float:
        x = dict(sizes or {})
        x[self.features[0]] = 1.0
        return sum(c * float(x.get(f, 0.0)) for f, c in zip(self.features, self.coef, strict=True))

    def residual(self, u: float) -> float:
        """The relative residual at quantile ``u`` in [0, 1] (linear between the stored levels)."""
        return float(np.interp(min(max(u, 0.0), 1.0), LEVELS, self.residuals))

    def draw(self, u: float, sizes: Mapping[str, float] | None = None) -> float:
        """Seconds of one occurrence at quantile ``u`` of the spread (``u`` uniform on [0, 1]: a sample)."""
        return max(0.0, self.predict(sizes) * (1.0 + self.residual(u)))

    def mean_factor(self) -> float:
        """``1 + E[r]``: what one occurrence costs on average over the prediction (the residual's quantile
        function integrated between the stored levels, as :meth:`residual` interpolates it)."""
        u, q = np.asarray(LEVELS), np.asarray(self.residuals)
        return 1.0 + float(np.sum(np.diff(u) * (q[1:] + q[:-1]) / 2))

    def expected(self, sizes: Mapping[str, float] | None = None) -> float:
        """Seconds one occurrence costs on average (the mean of :meth:`draw`)."""
        return max(0.0, self.predict(sizes)) * self.mean_factor()

    def scaled(self, factor: float) -> CostModel:
        """The same model on a host ``factor`` times as slow (the spread kept relative)."""
        return CostModel(self.features, tuple(c * factor for c in self.coef), self.residuals, self.samples)

    def tails(self) -> dict[str, float]:
        """The residual's median, p90, p99 and maximum (what a reader checks first)."""
        return {"p50": self.residual(0.5), "p90": self.residual(0.9), "p99": self.residual(0.99),
                "max": self.residual(1.0)}

    def to_json(self) -> dict[str, Any]:
        return {"features": list(self.features), "coef": list(self.coef), "samples": self.samples,
                "residual_levels": list(LEVELS), "residual_quantiles": list(self.residuals),
                "residual": self.tails()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CostModel:
        levels = tuple(float(x) for x in d.get("residual_levels", LEVELS))
        q = [float(x) for x in d["residual_quantiles"]]
        if levels != LEVELS:  # written with other levels: re-read at ours
            q = [float(np.interp(u, levels, q)) for u in LEVELS]
        feats, coef = tuple(str(f) for f in d["features"]), tuple(float(c) for c in d["coef"])
        if len(feats) != len(coef):
            raise ValueError(f"a cost model has {len(feats)} features and {len(coef)} coefficients")
        return cls(feats, coef, tuple(q), int(d.get("samples", 0)))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a·x - b|| subject to x >= 0, exactly: the optimum is the least-squares solution on its own
    support, so it is the best feasible one over all subsets of columns (2^n solves; n is at most 5 here).
    Subsets that fit equally well (columns that never vary apart, as a per-step and a per-user term when every
    batch has one user) go to the one with fewer columns, then the earlier ones: the constant first."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.dot(b, b))
    for mask in sorted(range(1, 1 << n), key=lambda m: (bin(m).count("1"), m)):
        cols = [i for i in range(n) if mask >> i & 1]
        z = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (z < 0).any():
            continue
        err = float(np.sum((a[:, cols] @ z - b) ** 2))
        if err < best_err * (1 - 1e-9) - 1e-300:
            best, best_err = np.zeros(n), err
            best[cols] = z
    return best


def fit(rows: Sequence[Mapping[str, float]], seconds: Sequence[float], features: Sequence[str]) -> CostModel:
    """A :class:`CostModel` of ``features`` (the first the constant) fitted to measured ``seconds``: relative
    non-negative least squares, then the relative residuals' quantiles. A feature that never varies from 0
    gets coefficient 0."""
    y = np.asarray(seconds, dtype=float)
    keep = y > 0
    if not keep.any():
        raise ValueError("nothing to fit: no occurrence took any time")
    feats = tuple(features)
    x = np.array([[1.0] + [float(r.get(f, 0.0)) for f in feats[1:]] for r in rows], dtype=float)[keep]
    y = y[keep]
    a = x / y[:, None]  # relative error: (x·c - y) / y
    scale = np.linalg.norm(a, axis=0)
    used = scale > 0
    coef = np.zeros(len(feats))
    coef[used] = nnls(a[:, used] / scale[used], np.ones(len(y))) / scale[used]
    pred = x @ coef
    r = np.where(pred > 0, y / np.maximum(pred, 1e-300) - 1.0, 0.0)
    q = tuple(float(v) for v in np.quantile(r, LEVELS))
    return CostModel(feats, tuple(float(c) for c in coef), q, len(y))


@dataclass
class CostProfile:
    """Costs of one deployment: compute steps by kind, a request's CPU by ``endpoint.phase`` (``rank.parse``
    ...), hops by name (``router``, ``harness``), host-device ``transfers`` (bytes per second by direction),
    the ``model`` they hold for and the ``host`` they were measured on; ``source`` says whether they were
    measured (``calibrated``) or derived from data sheets (``model``). ``startup``: the latency profiles the
    calibrated rankers measured at start-up (``GET /v1/profile``, on an idle core), which is what the real
    trigger's risk test reads: a simulated ranker reports these rather than its in-service costs, which
    differ from them (empty for a model: its costs have no spread, so a simulated start-up measures them)."""

    source: str
    host: dict[str, Any]
    model: dict[str, Any]
    steps: dict[str, CostModel]
    requests: dict[str, CostModel] = field(default_factory=dict)
    hops: dict[str, CostModel] = field(default_factory=dict)
    transfers: dict[str, float] = field(default_factory=dict)
    notes: str = ""
    version: int = PROFILE_VERSION
    startup: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source {self.source!r}: one of {', '.join(SOURCES)}")

    def step_s(self, kind: str, batch: int, tokens: int, context: int, pairs: int, u: float | None = None,
               cold: int = 0) -> float:
        """Seconds of a step of ``kind``: the model's prediction, or its draw at quantile ``u``. A profile
        fitted without ``cold`` (an older one, or a model's) ignores it."""
        m = self.steps[kind]
        sizes = {"batch": batch, "tokens": tokens, "context": context, "pairs": pairs, "cold": cold}
        return m.predict(sizes) if u is None else m.draw(u, sizes)

    def slowdown(self, steps: Sequence[Mapping[str, Any]]) -> tuple[float | None, int]:
        """How much slower the host ran ``steps`` (step log records of real service) than this profile says:
        their summed seconds over the summed :meth:`CostModel.expected` for their sizes, and how many steps
        counted (kinds the profile has). ``None`` when none did. A shared VM's speed drifts between runs by
        more than the spread within one, so a simulator judged against a run measures it there."""
        real = predicted = 0.0
        n = 0
        for r in steps:
            m = self.steps.get(str(r["kind"]))
            if m is None:
                continue
            real += float(r["seconds"])
            predicted += m.expected({f: float(r.get(f) or 0) for f in STEP_FEATURES[1:]})
            n += 1
        return (real / predicted if n and predicted > 0 else None), n

    def scaled(self, factor: float) -> CostProfile:
        """This profile on a host ``factor`` times as slow: the compute steps and the ranker's request CPU
        (both the replica's core) scaled; the hops (waits as much as work) and transfers kept."""
        if not factor > 0:
            raise ValueError(f"a speed factor must be positive, got {factor}")
        return replace(self, steps={k: m.scaled(factor) for k, m in self.steps.items()},
                       requests={k: m.scaled(factor) for k, m in self.requests.items()},
                       notes=f"{self.notes} (scaled x{factor:.3f} to the host's measured speed)".strip())

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "source": self.source, "host": self.host, "model": self.model,
                "steps": {k: m.to_json() for k, m in sorted(self.steps.items())},
                "requests": {k: m.to_json() for k, m in sorted(self.requests.items())},
                "hops": {k: m.to_json() for k, m in sorted(self.hops.items())},
                "transfers": dict(self.transfers), "notes": self.notes,
                **({"startup": list(self.startup)} if self.startup else {})}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CostProfile:
        version = int(d.get("version", 0))
        if version != PROFILE_VERSION:
            raise ValueError(f"cost profile version {version}; this grstack reads version {PROFILE_VERSION}")

        def models(key: str) -> dict[str, CostModel]:
            return {k: CostModel.from_json(v) for k, v in d.get(key, {}).items()}

        return cls(source=str(d["source"]), host=dict(d.get("host", {})), model=dict(d.get("model", {})),
                   steps=models("steps"), requests=models("requests"), hops=models("hops"),
                   transfers={k: float(v) for k, v in d.get("transfers", {}).items()}, notes=str(d.get("notes", "")),
                   version=version, startup=[dict(x) for x in d.get("startup", [])])

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(_finite(self.to_json()), indent=2) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        return cls.from_json(json.loads(Path(path).read_text()))


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def fit_steps(steps: Sequence[Mapping[str, Any]]) -> dict[str, CostModel]:
    """One :class:`CostModel` per step kind, from step records (``GET /v1/steps``'s ``steps``)."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for s in steps:
        by.setdefault(str(s["kind"]), []).append(s)
    return {k: fit(rows, [float(r["seconds"]) for r in rows], STEP_FEATURES) for k, rows in sorted(by.items())
            if any(float(r["seconds"]) > 0 for r in rows)}


def fit_requests(requests: Sequence[Mapping[str, Any]]) -> dict[str, CostModel]:
    """One :class:`CostModel` per ``endpoint.phase`` (parse, encode, reply), from request records."""
    out: dict[str, CostModel] = {}
    for endpoint in sorted({str(r["endpoint"]) for r in requests}):
        rows = [r for r in requests if r["endpoint"] == endpoint]
        for phase in ("parse", "encode", "reply"):
            secs = [float(r[f"{phase}_s"]) for r in rows]
            if any(s > 0 for s in secs):
                out[f"{endpoint}.{phase}"] = fit(rows, secs, REQUEST_FEATURES)
    return out


def fit_hops(hops: Mapping[str, Sequence[float]]) -> dict[str, CostModel]:
    """One constant :class:`CostModel` per hop from its measured seconds: the median, and the spread around it
    in the residuals (a hop too short to resolve, 0 s, is kept: its residual is -1)."""
    out = {}
    for k, v in sorted(hops.items()):
        y = np.asarray(v, dtype=float)
        mid = float(np.median(y)) if len(y) else 0.0
        if mid <= 0:
            continue
        q = tuple(float(x) for x in np.quantile(y / mid - 1.0, LEVELS))
        out[k] = CostModel(HOP_FEATURES, (mid,), q, len(y))
    return out
