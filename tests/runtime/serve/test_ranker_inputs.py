"""The ranker serves a model that reads actions and user context: requests carry each event's action bits and
the user's features (raw tokens mapped through the artefact's vocabularies); a hit equals full inference and
the oracle; a changed attribute or action is another prefix version; what the model cannot read is a 422."""

from __future__ import annotations

import json
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
import torch

from grstack.runtime.model import HSTU
from grstack.runtime.serve.ranker import RankerConfig, RankerService, start_ranker

pytestmark = pytest.mark.integration

VOCAB = {"age": ["18", "25", "35", "45", "56"], "tags": ["a", "b", "c", "d"]}


def make_model() -> HSTU:
    torch.manual_seed(0)
    m = HSTU(300, max_len=48, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0, input_dropout=0.0,
             time_buckets=32, num_tasks=3, user_features={k: len(v) for k, v in VOCAB.items()}, action_inputs=True)
    with torch.no_grad():
        m.item_emb.weight[301:].normal_(0.0, 1.0)
        m.action_emb.weight.normal_(0.0, 1.0)
        for layer in m.layers:  # attention visibly carries the context tokens to the candidates
            layer.uvqk.weight.normal_(0.0, 0.3)
    return m.eval()


def body(user: str, seed: int = 1, n_long: int = 20, n_short: int = 4, feats: dict | None = None) -> dict:
    rng = np.random.default_rng(seed)
    n = n_long + n_short
    items = rng.integers(1, 301, n).tolist()
    ts = (1_600_000_000 + np.cumsum(rng.integers(1, 999, n))).tolist()
    acts = rng.integers(0, 4, n).tolist()
    return {"user_id": user,
            "long_term": {"items": items[:n_long], "timestamps": ts[:n_long], "actions": acts[:n_long]},
            "short_term": {"items": items[n_long:], "timestamps": ts[n_long:], "actions": acts[n_long:]},
            "candidates": [3, 1, 4, 1, 5], "timestamp": ts[-1] + 10,
            "user_features": feats if feats is not None else {"age": ["25"], "tags": ["c", "a"]}}


@pytest.fixture(params=[False, True], ids=["tensors", "kv-arena"])
async def ranker(request):
    cfg = RankerConfig(max_suffix=8, chunk=8, kv_arena=request.param, device_cache_bytes=1 << 20)
    service = RankerService(make_model(), ["next", "click", "like"], cfg, user_vocab=VOCAB)
    runner, url = await start_ranker(service)
    async with aiohttp.ClientSession() as session:
        yield SimpleNamespace(service=service, url=url, http=session)
    await runner.cleanup()


async def post(r: SimpleNamespace, path: str, payload: dict) -> tuple[int, dict]:
    async with r.http.post(r.url + path, data=json.dumps(payload).encode()) as resp:
        return resp.status, await resp.json()


def oracle(service: RankerService, b: dict, context: np.ndarray) -> np.ndarray:
    eng = service.engine
    lt, st = b["long_term"], b["short_term"]
    item = eng.canonical(lt["items"], lt["timestamps"], st["items"], st["timestamps"], b["candidates"],
                         b["timestamp"], lt["actions"], st["actions"], context)
    return eng.rank_encode([item])[0].numpy()


async def test_a_hit_equals_full_inference_and_the_oracle(ranker: SimpleNamespace) -> None:
    b = body("alice")
    status, miss = await post(ranker, "/v1/rank", {**b, "user_id": "bob"})
    assert status == 200 and miss["cache"] == "miss"
    status, pre = await post(ranker, "/v1/prefill", {k: b[k] for k in ("user_id", "long_term", "user_features")})
    assert status == 200 and pre["status"] == "computed" and pre["prefix_len"] == 20
    status, hit = await post(ranker, "/v1/rank", b)
    assert status == 200 and hit["cache"] == "device" and hit["prefix_hash"] == pre["prefix_hash"]
    context = np.array([[2, 0], [1, 3]])  # age "25" -> 2; tags "a", "c" -> 1, 3
    want = oracle(ranker.service, b, context)
    assert np.abs(np.array(hit["scores"]) - want).max() <= 1e-5
    assert np.abs(np.array(miss["scores"]) - want).max() <= 1e-5
    profile = ranker.service.profile
    assert profile.action_names == ["click", "like"] and profile.user_fields == ["age", "tags"]


async def test_changed_attributes_or_actions_are_another_version(ranker: SimpleNamespace) -> None:
    b = body("carol", seed=2)
    await post(ranker, "/v1/prefill", {k: b[k] for k in ("user_id", "long_term", "user_features")})
    _, hit = await post(ranker, "/v1/rank", b)
    assert hit["cache"] == "device"
    # the order of a field's values does not matter (they are pooled): the same version
    same = {**b, "user_features": {"tags": ["a", "c"], "age": ["25"]}}
    assert (await post(ranker, "/v1/rank", same))[1]["cache"] == "device"
    older = {**b, "user_features": {"age": ["35"], "tags": ["a", "c"]}}
    _, other = await post(ranker, "/v1/rank", older)
    assert other["cache"] == "miss" and other["prefix_hash"] != hit["prefix_hash"]
    assert np.abs(np.array(other["scores"]) - np.array(hit["scores"])).max() > 1e-4
    acts = list(b["long_term"]["actions"])
    acts[3] ^= 1
    _, moved = await post(ranker, "/v1/rank", {**b, "long_term": {**b["long_term"], "actions": acts}})
    assert moved["cache"] == "miss"
    # a value the model never saw is no value, as in training for a user without one
    _, unseen = await post(ranker, "/v1/rank", {**b, "user_id": "x1", "user_features": {"age": ["99"], "tags": []}})
    _, none = await post(ranker, "/v1/rank", {**b, "user_id": "x2", "user_features": {}})
    assert np.abs(np.array(unseen["scores"]) - np.array(none["scores"])).max() <= 1e-6


async def test_an_older_prefix_is_extended_with_its_actions(ranker: SimpleNamespace) -> None:
    b = body("dora", seed=3, n_long=24)
    older = {**b, "long_term": {k: v[:15] for k, v in b["long_term"].items()}}
    await post(ranker, "/v1/prefill", {k: older[k] for k in ("user_id", "long_term", "user_features")})
    status, pre = await post(ranker, "/v1/prefill", {k: b[k] for k in ("user_id", "long_term", "user_features")})
    assert status == 200 and pre["reused_len"] == 15
    _, hit = await post(ranker, "/v1/rank", b)
    want = oracle(ranker.service, b, np.array([[2, 0], [1, 3]]))
    assert hit["cache"] == "device" and np.abs(np.array(hit["scores"]) - want).max() <= 1e-5


@pytest.mark.parametrize(("change", "says"), [
    (lambda b: b["long_term"].pop("actions"), "long_term.actions: this model reads each event's actions "
                                              "(bits: click = 1, like = 2); the request has none"),
    (lambda b: b["short_term"]["actions"].__setitem__(1, 4), "short_term.actions[1]: 4 sets a bit beyond this "
                                                             "model's actions (click = 1, like = 2)"),
    (lambda b: b["user_features"].__setitem__("zip", ["1"]), "user_features: 'zip' is not a field this model reads "
                                                             "(age, tags)"),
    (lambda b: b["long_term"]["actions"].pop(), "actions (19) and items (20) must have the same length"),
    (lambda b: b["long_term"]["actions"].__setitem__(0, -1), "greater than or equal to 0"),
])
async def test_what_the_model_cannot_read_is_a_422(ranker: SimpleNamespace, change, says: str) -> None:
    b = body("erin", seed=4)
    change(b)
    status, err = await post(ranker, "/v1/rank", b)
    assert status == 422 and says in err["error"]
    assert ranker.service.stats().ranks == 0


async def test_through_the_router_the_signal_and_the_rank_agree_on_the_version() -> None:
    """The router versions a signal's prefix as the ranker does (actions and user features included), so the
    trigger's book-keeping follows the prefix the ranker caches; a signal without actions is refused there."""
    from grstack.runtime.serve.router import Router, RouterConfig, start_router
    from grstack.runtime.serve.trigger import TriggerConfig

    service = RankerService(make_model(), ["next", "click", "like"], RankerConfig(max_suffix=8, chunk=8),
                            user_vocab=VOCAB)
    ranker_runner, ranker_url = await start_ranker(service)
    router = Router(RouterConfig(rankers=(ranker_url,), trigger=TriggerConfig(length_threshold=4),
                                 health_interval_s=0.3, startup_timeout_s=30))
    runner, url = await start_router(router)
    try:
        async with aiohttp.ClientSession() as http:
            r = SimpleNamespace(url=url, http=http)
            b = body("frank", seed=5)
            signal = {k: b[k] for k in ("user_id", "long_term", "user_features")}
            status, pre = await post(r, "/v1/prefill", {**signal, "wait": True})
            assert status == 200 and pre["admitted"] and pre["ranker"]["status"] == "computed"
            assert router.trigger.live_version("frank") == pre["ranker"]["prefix_hash"]
            status, hit = await post(r, "/v1/rank", b)
            assert status == 200 and hit["cache"] == "device" and hit["prefix_hash"] == pre["ranker"]["prefix_hash"]
            no_actions = {**signal, "long_term": {k: v for k, v in b["long_term"].items() if k != "actions"}}
            status, err = await post(r, "/v1/prefill", no_actions)
            assert status == 422 and "long_term.actions: the served model reads each event's actions" in err["error"]
    finally:
        await runner.cleanup()
        await ranker_runner.cleanup()
