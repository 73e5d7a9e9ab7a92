"""Relay inference is exact: cached-prefix ranking equals HSTU.encode + rank_logits on the full sequence."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grstack.runtime.serve.engine import RankItem, RelayEngine
from grstack.runtime.serve.prefix import prefix_hash

pytestmark = pytest.mark.unit

TOL = 1e-5
NUM_ITEMS = 300  # conftest's tiny model


@pytest.fixture
def make_model(kit: SimpleNamespace):
    return kit.make_model


def random_request(eng: RelayEngine, rng: np.random.Generator, n_long: int, n_short: int, m: int) -> RankItem:
    n = n_long + n_short
    items = rng.integers(1, NUM_ITEMS + 1, n)
    ts = 1_600_000_000 + np.cumsum(rng.integers(0, 5000, n))  # includes equal timestamps
    cands = rng.integers(1, NUM_ITEMS + 1, m)
    return eng.canonical(items[:n_long], ts[:n_long], items[n_long:], ts[n_long:], cands, int(ts[-1]) + 7)


# reference: the CPU prefix path (head-major cache); padded: the plain formulation (token-major cache)
@pytest.mark.parametrize("backend", ["reference", "padded"])
@pytest.mark.parametrize(("time_bias", "position_bias"), [(True, True), (False, True), (True, False)])
def test_cached_scores_equal_full_inference(make_model, backend: str, time_bias: bool,
                                            position_bias: bool) -> None:
    eng = RelayEngine(make_model(time_bias=time_bias, position_bias=position_bias), max_suffix=8, chunk=5,
                      backend=backend)
    rng = np.random.default_rng(1)
    worst = 0.0
    for n_long, n_short, m in [(1, 0, 1), (7, 3, 4), (17, 8, 6), (40, 8, 3), (0, 5, 2), (23, 0, 5)]:
        req = random_request(eng, rng, n_long, n_short, m)
        full = eng.rank_encode([req])[0]
        assert full.shape == (m, 2)
        prefix = eng.prefill(req.long_items, req.long_ts)
        assert prefix.length == len(req.long_items)
        cached = eng.rank_cached([prefix], [req])[0]
        worst = max(worst, float((cached - full).abs().max()))
        assert torch.allclose(eng.rank_full([req])[0], full, atol=TOL, rtol=0)
    assert worst <= TOL


@pytest.mark.parametrize("backend", ["reference", "padded"])
def test_fuxi_cached_scores_equal_full_inference(backend: str) -> None:
    """FuXi-α serves from cached prefixes exactly too (its positional and temporal channels read the cached
    values and timestamps)."""
    from grstack.runtime.model import FuXiAlpha

    torch.manual_seed(0)
    model = FuXiAlpha(NUM_ITEMS, max_len=64, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0,
                      input_dropout=0.0, time_buckets=32, num_tasks=2).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.pos_weight.normal_(0.0, 0.5)
            layer.time_weight.normal_(0.0, 0.5)
    eng = RelayEngine(model, max_suffix=8, chunk=5, backend=backend)
    rng = np.random.default_rng(4)
    for n_long, n_short, m in [(7, 3, 4), (30, 8, 3), (0, 5, 2)]:
        req = random_request(eng, rng, n_long, n_short, m)
        full = eng.rank_encode([req])[0]
        cached = eng.rank_cached([eng.prefill(req.long_items, req.long_ts)], [req])[0]
        assert cached.shape == (m, 2) and float((cached - full).abs().max()) <= TOL


def test_batched_requests_match_one_by_one_and_the_oracle(make_model) -> None:
    eng = RelayEngine(make_model(), max_suffix=8, chunk=16)
    rng = np.random.default_rng(2)
    reqs = [random_request(eng, rng, n_long, n_short, m) for n_long, n_short, m in
            [(30, 8, 3), (5, 1, 7), (12, 0, 2), (39, 4, 5)]]
    prefixes = [eng.prefill(r.long_items, r.long_ts) for r in reqs]
    together = eng.rank_cached(prefixes, reqs)
    oracle = eng.rank_encode(reqs)  # jagged batch of different lengths and candidate counts
    for r, p, t, o in zip(reqs, prefixes, together, oracle, strict=True):
        assert torch.allclose(t, eng.rank_cached([p], [r])[0], atol=TOL, rtol=0)
        assert torch.allclose(t, o, atol=TOL, rtol=0)
    assert [t.shape[0] for t in together] == [3, 7, 2, 5]


def test_prefix_kv_does_not_depend_on_chunking(make_model) -> None:
    model = make_model()
    rng = np.random.default_rng(3)
    items = rng.integers(1, NUM_ITEMS + 1, 37)
    ts = 1_600_000_000 + np.cumsum(rng.integers(1, 100, 37))
    whole = RelayEngine(model, max_suffix=8, chunk=1000).prefill(items, ts)
    steps = RelayEngine(model, max_suffix=8, chunk=4).prefill(items, ts)
    for a, b in zip(whole.keys + whole.values, steps.keys + steps.values, strict=True):
        assert a.shape == b.shape == (2, 37, 8)
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert whole.nbytes == 2 * 2 * 2 * 37 * 8 * 4 + 37 * 8


def test_serving_truncation_is_the_same_for_cached_and_full(make_model, kit: SimpleNamespace) -> None:
    eng = RelayEngine(make_model(), max_suffix=6, chunk=8)
    MAX_LEN = kit.MAX_LEN
    assert eng.max_prefix == MAX_LEN - 6
    rng = np.random.default_rng(4)
    req = random_request(eng, rng, 100, 20, 3)  # both parts longer than their budgets
    assert len(req.long_items) == MAX_LEN - 6 and len(req.short_items) == 6
    prefix = eng.prefill(req.long_items, req.long_ts)
    assert torch.allclose(eng.rank_cached([prefix], [req])[0], eng.rank_encode([req])[0], atol=TOL, rtol=0)


def test_prefix_hash_versions_content() -> None:
    a = prefix_hash(np.array([1, 2, 3]), np.array([10, 20, 30]))
    assert a == prefix_hash(np.array([1, 2, 3]), np.array([10, 20, 30]))
    assert a != prefix_hash(np.array([1, 2, 3]), np.array([10, 20, 31]))
    assert a != prefix_hash(np.array([1, 2, 4]), np.array([10, 20, 30]))


def test_engine_rejects_a_model_without_ranking_head(make_model, kit: SimpleNamespace) -> None:
    from grstack.runtime.model.hstu import HSTU

    with pytest.raises(ValueError, match="ranking head"):
        RelayEngine(HSTU(10, max_len=8, d_model=8, num_blocks=1, num_heads=1, dqk=4, dv=4, ranking_head=False))
    with pytest.raises(ValueError, match="max_suffix"):
        RelayEngine(make_model(), max_suffix=kit.MAX_LEN)


def test_a_prefix_still_being_copied_is_waited_for_before_it_is_read() -> None:
    from grstack.runtime.serve.engine import PrefixKV

    class Event:  # stands in for the torch.cuda.Event of a side-stream copy (CPU target: synchronize)
        waited = 0

        def synchronize(self) -> None:
            Event.waited += 1

    t = torch.arange(6.0).reshape(1, 3, 2)
    kv = PrefixKV([t], [t + 1], torch.arange(3), ready=Event())
    moved = kv.to("cpu")
    assert Event.waited == 1 and moved.ready is None and torch.equal(moved.values[0], t + 1)
    assert PrefixKV([t], [t], torch.arange(3)).to("cpu").length == 3 and Event.waited == 1


@pytest.mark.parametrize("backend", ["reference", "padded"])
def test_item_side_features_are_served_exactly(backend: str) -> None:
    """A model with item side features: the ranker reads every history item's and candidate's features from
    the model's own map, and cached-prefix scores equal full inference."""
    from grstack.runtime.data.features import FeatureField, Features
    from grstack.runtime.model import HSTU, ItemFeatureMap

    ids = np.arange(1, NUM_ITEMS + 1)
    genre = FeatureField("genre", np.concatenate([[0], np.cumsum(1 + ids % 3)]),
                         np.concatenate([(i + np.arange(1 + i % 3)) % 7 + 1 for i in ids]),
                         np.array([f"g{k}" for k in range(7)]))
    fmap = ItemFeatureMap.from_features(Features("item", NUM_ITEMS, [genre]), NUM_ITEMS)
    torch.manual_seed(0)
    model = HSTU(NUM_ITEMS, max_len=64, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0,
                 input_dropout=0.0, time_buckets=32, num_tasks=2, item_features=fmap).eval()
    with torch.no_grad():
        model.item_emb.weight[NUM_ITEMS + 1:].normal_(0.0, 1.0)  # features visibly matter
    eng = RelayEngine(model, max_suffix=8, chunk=5, backend=backend)
    rng = np.random.default_rng(5)
    for n_long, n_short, m in [(7, 3, 4), (30, 8, 3), (0, 5, 2)]:
        req = random_request(eng, rng, n_long, n_short, m)
        full = eng.rank_encode([req])[0]
        cached = eng.rank_cached([eng.prefill(req.long_items, req.long_ts)], [req])[0]
        assert cached.shape == (m, 2) and float((cached - full).abs().max()) <= TOL
