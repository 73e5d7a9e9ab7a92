"""The cache's K/V dtype: fp32 (the default) stays exact; bf16 halves every byte figure and keeps scores close
to full inference, on plain tensors, in a KV arena and through a ranker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grstack.runtime.serve.engine import RelayEngine, resolve_kv_dtype
from grstack.runtime.serve.kv_arena import KVArena, bytes_per_token

pytestmark = pytest.mark.unit

# bf16 keeps 8 mantissa bits: a rounded K/V entry moves by <= 2^-9 relative. Measured on the tiny model below:
# max |cached - full| 5.0e-4 (both backends); the bound leaves 10x headroom without hiding a wrong path.
BF16_TOL = 5e-3


def history(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 300, n), 1_600_000_000 + np.cumsum(rng.integers(1, 5000, n))


def requests(eng: RelayEngine, lengths: tuple[int, ...]) -> list:
    out = []
    for u, n in enumerate(lengths):
        items, ts = history(n + 6, seed=u)
        out.append(eng.canonical(items[:n], ts[:n], items[n:], ts[n:], [1, 2, 3, 4, 5], int(ts[-1]) + 1))
    return out


def test_default_keeps_the_models_dtype_and_fp32_bytes(kit) -> None:
    model = kit.make_model(max_len=120)
    eng = RelayEngine(model, max_suffix=8)
    assert eng.kv_dtype == torch.float32
    assert eng.kv_bytes_per_token == model.kv_elements_per_token * 4 + 8 == bytes_per_token(model)
    assert resolve_kv_dtype("fp32", torch.float32) == torch.float32
    with pytest.raises(ValueError, match="kv_dtype"):
        resolve_kv_dtype("int3", torch.float32)


def test_bf16_kv_is_stored_in_bf16_and_counted_at_two_bytes(kit) -> None:
    model = kit.make_model(max_len=120)
    eng = RelayEngine(model, max_suffix=8, chunk=16, kv_dtype="bf16")
    assert eng.kv_bytes_per_token == model.kv_elements_per_token * 2 + 8
    items, ts = history(50)
    kv = eng.prefill(items, ts)
    assert all(t.dtype == torch.bfloat16 for t in (*kv.keys, *kv.values))
    assert kv.nbytes == 50 * eng.kv_bytes_per_token
    arena = KVArena.from_budget(eng.model, 100 * eng.kv_bytes_per_token, backend=eng.backend,
                                kv_dtype=eng.kv_dtype)
    assert arena.capacity == 100 and arena.bytes_per_token == eng.kv_bytes_per_token
    assert all(t.dtype == torch.bfloat16 for t in (*arena.keys, *arena.values))


@pytest.mark.parametrize("backend", ["reference", "padded"])
def test_bf16_kv_scores_stay_close_to_full_inference(kit, backend: str) -> None:
    model = kit.make_model(max_len=120)
    exact = RelayEngine(model, max_suffix=8, chunk=16, backend=backend)
    eng = RelayEngine(model, max_suffix=8, chunk=16, backend=backend, kv_dtype="bf16")
    reqs = requests(eng, (60, 5, 90, 17))
    full = exact.rank_encode(reqs)
    plain = [eng.prefill(r.long_items, r.long_ts) for r in reqs]
    arena = KVArena(eng.model, 400, backend=eng.backend, kv_dtype=eng.kv_dtype)
    views = [eng.prefill(r.long_items, r.long_ts, arena.prefix(arena.alloc(len(r.long_items)))) for r in reqs]
    # a batched chunk step (extend_many) into the arena and onto plain tensors
    batched = [arena.prefix(arena.alloc(len(reqs[0].long_items))), eng.empty_prefix()]
    for s in range(0, len(reqs[0].long_items), 16):
        batched = eng.extend_many(batched, [reqs[0].long_items[s:s + 16]] * 2, [reqs[0].long_ts[s:s + 16]] * 2)
    got = [*eng.rank_cached(plain, reqs), *eng.rank_cached(views, reqs),
           *eng.rank_cached(batched, [reqs[0], reqs[0]])]
    want = [*full, *full, full[0], full[0]]
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    assert 0 < worst <= BF16_TOL  # rounded, yet close
    # fp32 on the same path stays exact
    exact_kv = [exact.prefill(r.long_items, r.long_ts) for r in reqs]
    for g, w in zip(exact.rank_cached(exact_kv, reqs), full, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arena", [True, False])
async def test_ranker_with_bf16_kv_counts_real_bytes_and_scores_close(kit, arena: bool) -> None:
    from grstack.runtime.serve.ranker import RankerConfig, RankerService
    from grstack.runtime.serve.schemas import PrefillRequest, RankRequest

    service = RankerService(kit.make_model(), ["next", "click"],
                            RankerConfig(max_suffix=8, chunk=8, kv_arena=arena, device_cache_bytes=1 << 20,
                                         kv_dtype="bf16"))
    service.scheduler.start()
    try:
        items, ts = history(40, seed=3)
        body = dict(user_id="u", long_term={"items": items[:30].tolist(), "timestamps": ts[:30].tolist()},
                    short_term={"items": items[30:].tolist(), "timestamps": ts[30:].tolist()},
                    candidates=[7, 8, 9], timestamp=int(ts[-1]) + 1)
        assert (await service.prefill(PrefillRequest(user_id="u", long_term=body["long_term"]))).status == "computed"
        res = await service.rank(RankRequest(**body))
        assert res.cache == "device"
        eng = service.engine
        assert service.cache.device_used == 30 * eng.kv_bytes_per_token
        assert eng.kv_bytes_per_token == eng.model.kv_elements_per_token * 2 + 8
        full = eng.rank_encode([eng.canonical(items[:30], ts[:30], items[30:], ts[30:], [7, 8, 9],
                                              body["timestamp"])])[0]
        np.testing.assert_allclose(np.array(res.scores), full.numpy(), atol=BF16_TOL)
    finally:
        await service.scheduler.stop()
