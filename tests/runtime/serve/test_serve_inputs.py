"""Serving a model that reads actions and user context: cached-prefix ranking stays exact (equal to
``HSTU.encode`` on the whole sequence with its contextual tokens and action vectors), however the prefix is
chunked, batched or extended, and the ranker maps requests' actions and user features or refuses them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grstack.runtime.model import HSTU, FuXiAlpha
from grstack.runtime.serve.engine import RankItem, RelayEngine

pytestmark = pytest.mark.unit

TOL = 1e-5
NUM_ITEMS = 300
USER_FIELDS = {"age": 5, "gender": 2, "tags": 6}  # value counts; tags is multi-valued
ACTIONS = ("click", "like")


def make_model(kind: type[HSTU] = HSTU, seed: int = 0) -> HSTU:
    torch.manual_seed(seed)
    m = kind(NUM_ITEMS, max_len=48, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0,
             input_dropout=0.0, time_buckets=32, num_tasks=1 + len(ACTIONS), user_features=dict(USER_FIELDS),
             action_inputs=True)
    with torch.no_grad():  # larger than the init scale, so context, actions and biases visibly matter
        m.item_emb.weight[NUM_ITEMS + 1:].normal_(0.0, 1.0)
        m.action_emb.weight.normal_(0.0, 1.0)
        for layer in m.layers:
            layer.uvqk.weight.normal_(0.0, 0.3)
            layer.pos_weight.normal_(0.0, 0.5)
            layer.time_weight.normal_(0.0, 0.5)
    return m.eval()


def context(rng: np.random.Generator) -> np.ndarray:
    c = np.zeros((3, 3), dtype=np.int64)
    c[0, 0] = rng.integers(1, 6)
    c[1, 0] = rng.integers(1, 3)
    c[2, :3] = rng.choice(np.arange(1, 7), 3, replace=False)
    return c


def request(eng: RelayEngine, rng: np.random.Generator, n_long: int, n_short: int, m: int) -> RankItem:
    n = n_long + n_short
    items = rng.integers(1, NUM_ITEMS + 1, n)
    ts = 1_600_000_000 + np.cumsum(rng.integers(0, 5000, n))
    acts = rng.integers(0, 4, n)
    return eng.canonical(items[:n_long], ts[:n_long], items[n_long:], ts[n_long:], rng.integers(1, NUM_ITEMS + 1, m),
                         int(ts[-1]) + 7, acts[:n_long], acts[n_long:], context(rng))


@pytest.mark.parametrize("kind", [HSTU, FuXiAlpha])
@pytest.mark.parametrize("backend", ["reference", "padded"])
@pytest.mark.parametrize("chunk", [2, 3, 16])  # the first chunk: context only, context and events, all
def test_cached_scores_equal_full_inference_with_actions_and_context(kind, backend: str, chunk: int) -> None:
    eng = RelayEngine(make_model(kind), max_suffix=8, chunk=chunk, backend=backend)
    assert (eng.action_bits, eng.head) == (2, 3)
    rng = np.random.default_rng(1)
    for n_long, n_short, m in [(1, 0, 1), (7, 3, 4), (30, 8, 3), (0, 5, 2), (23, 0, 5)]:
        req = request(eng, rng, n_long, n_short, m)
        full = eng.rank_encode([req])[0]
        assert full.shape == (m, 3)
        assert torch.allclose(eng.rank_full([req])[0], full, atol=TOL, rtol=0)
        if not n_long:
            continue
        tokens = eng.item_tokens(req)
        assert len(tokens) == 3 + n_long and tokens.items[:3].tolist() == [0, 0, 0]
        prefix = eng.prefill_tokens(tokens)
        assert prefix.length == 3 + n_long
        assert float((eng.rank_cached([prefix], [req])[0] - full).abs().max()) <= TOL


def test_the_inputs_change_the_scores() -> None:
    """The check above would pass with inputs ignored on both sides; the oracle itself must read them."""
    eng = RelayEngine(make_model(), max_suffix=8, chunk=4)
    rng = np.random.default_rng(2)
    req = request(eng, rng, 12, 3, 4)
    base = eng.rank_encode([req])[0]
    other_actions = RankItem(**{**req.__dict__, "long_actions": (req.long_actions + 1) % 4})
    other_context = RankItem(**{**req.__dict__, "context": np.zeros_like(req.context)})
    for changed in (other_actions, other_context):
        assert float((eng.rank_encode([changed])[0] - base).abs().max()) > 1e-3
        prefix = eng.prefill_tokens(eng.item_tokens(changed))
        assert torch.allclose(eng.rank_cached([prefix], [changed])[0], eng.rank_encode([changed])[0], atol=TOL)


def test_batched_and_extended_prefixes_are_exact() -> None:
    eng = RelayEngine(make_model(), max_suffix=8, chunk=5)
    rng = np.random.default_rng(3)
    reqs = [request(eng, rng, n, 4, 3) for n in (2, 11, 26)]
    toks = [eng.item_tokens(r) for r in reqs]
    # one jagged call per step over prefixes at different stages (one still inside its context tokens)
    kvs = [eng.empty_prefix() for _ in reqs]
    starts = [0, 0, 0]
    while any(s < len(t) for s, t in zip(starts, toks, strict=True)):
        parts = [t.slice(s, s + 4) for s, t in zip(starts, toks, strict=True)]
        kvs = eng.extend_many(kvs, [p.items for p in parts], [p.ts for p in parts], [p.actions for p in parts],
                              [p.context for p in parts])
        starts = [s + 4 for s in starts]
    oracle = eng.rank_encode(reqs)
    assert [kv.length for kv in kvs] == [3 + 2, 3 + 11, 3 + 26]
    for got, want in zip(eng.rank_cached(kvs, reqs), oracle, strict=True):
        assert float((got - want).abs().max()) <= TOL
    # an older prefix extended by the new events equals the whole prefix computed from scratch
    t = toks[2]
    old = eng.prefill(t.items[:9], t.ts[:9], actions=t.actions[:9], context=t.context)
    grown = eng.extend(old, t.items[9:], t.ts[9:], t.actions[9:], t.context)
    whole = eng.prefill_tokens(t)
    for a, b in zip(grown.keys + grown.values, whole.keys + whole.values, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_missing_inputs_are_refused_by_the_engine() -> None:
    eng = RelayEngine(make_model(), max_suffix=8, chunk=5)
    with pytest.raises(ValueError, match="long_actions: the model reads each event's actions; none were given"):
        eng.canonical([1, 2], [1, 2], [], [], [3], 5)
    with pytest.raises(ValueError, match=r"context: expected \[3, W\] value ids"):
        eng.canonical([1, 2], [1, 2], [], [], [3], 5, [0, 1], [], np.zeros((2, 1), dtype=np.int64))
    no_context = eng.canonical([1, 2], [1, 2], [], [], [3], 5, [0, 1], [])
    assert no_context.context.shape == (3, 1) and not no_context.context.any()  # no values: zero tokens
