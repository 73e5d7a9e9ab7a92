"""The ranker under overload: a bounded queue answers 503 + Retry-After, expired work is dropped before
compute, a rank predicted to finish late is refused at once, a rank joins an in-flight prefill, hit rate
counts rank lookups only, queue/prefill histograms."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest

from grstack.runtime.serve.ranker import RankerConfig, RankerService, start_ranker
from grstack.runtime.serve.scheduler import StepCost

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def rank_body(user: str, seed: int, n_long: int = 30, n_short: int = 5) -> dict:
    rng = np.random.default_rng(seed)
    n = n_long + n_short
    items = rng.integers(1, 301, n).tolist()
    ts = (1_600_000_000 + np.cumsum(rng.integers(1, 999, n))).tolist()
    return {"user_id": user, "long_term": {"items": items[:n_long], "timestamps": ts[:n_long]},
            "short_term": {"items": items[n_long:], "timestamps": ts[n_long:]}, "candidates": [3, 1, 4, 1, 5],
            "timestamp": ts[-1] + 10}


def count_calls(service: RankerService) -> dict[str, int]:
    """Wraps the engine's compute entry points with call counters."""
    calls = {"rank_full": 0, "rank_cached": 0, "extend": 0}
    eng = service.engine
    for name in calls:
        orig = getattr(eng, name)

        def wrapped(*a, _orig=orig, _name=name, **kw):
            calls[_name] += 1
            return _orig(*a, **kw)

        setattr(eng, name, wrapped)
    return calls


HOLDS: list[threading.Event] = []


class Hold:
    """Occupies the ranker's compute thread until released (the queue fills behind it)."""

    def __init__(self, service: RankerService) -> None:
        self.event = threading.Event()
        HOLDS.append(self.event)
        self.task = asyncio.ensure_future(service.scheduler.run_sync(self.event.wait))

    async def release(self) -> None:
        self.event.set()
        await self.task


@pytest.fixture
async def make(kit: SimpleNamespace):
    runners = []

    async def _make(**kw) -> SimpleNamespace:
        cfg = RankerConfig(**{"max_suffix": 8, "chunk": 64, **kw})
        service = RankerService(kit.make_model(), ["next", "click"], cfg)
        runner, url = await start_ranker(service)
        runners.append(runner)
        return SimpleNamespace(service=service, url=url)

    async with aiohttp.ClientSession() as http:
        try:
            yield _make, http
        finally:
            for ev in HOLDS:  # a failed test must not leave the compute thread blocked
                ev.set()
    for r in runners:
        await r.cleanup()


async def post(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None):
    async with http.post(url, data=json.dumps(body).encode(), headers=headers or {}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def until(pred, what: str, timeout_s: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < end, what
        await asyncio.sleep(0.005)


async def test_full_queue_answers_503_with_retry_after_and_loses_nothing_queued(make) -> None:
    factory, http = make
    r = await factory(max_batch=1, max_queue=2)
    sched = r.service.scheduler
    solo = [(await post(http, r.url + "/v1/rank", rank_body(f"u{i}", i)))[1]["scores"] for i in range(6)]
    hold = Hold(r.service)
    first = asyncio.ensure_future(post(http, r.url + "/v1/rank", rank_body("u0", 0)))
    await until(lambda: sched.runner._executor._work_queue.qsize() == 1 and sum(sched.depth().values()) == 0,
                "the first rank waits on the compute thread, off the queue")
    rest = [asyncio.ensure_future(post(http, r.url + "/v1/rank", rank_body(f"u{i}", i))) for i in range(1, 6)]
    await until(lambda: sum(t.done() for t in rest) == 3, "three of five refused at once")
    refused = [t.result() for t in rest if t.done()]
    for status, body, headers in refused:
        assert status == 503 and headers["Retry-After"] == "1" and "overloaded" in body["error"]
        assert headers["X-Grstack-Shed"] == "queue-full"
    assert sched.depth()["misses"] == 2
    await hold.release()
    accepted = [first] + [t for t in rest if t not in [x for x in rest if x.done()] or t.result()[0] == 200]
    results = await asyncio.gather(*accepted)
    ok = [(s, b) for s, b, _ in results if s == 200]
    assert len(ok) == 3  # the one computing and the two queued all answered, with the right scores
    for _, b in ok:
        i = int(b["user_id"][1:])
        assert np.abs(np.array(b["scores"]) - np.array(solo[i])).max() <= 1e-5
    text = await (await http.get(r.url + "/metrics")).text()
    assert 'grstack_ranker_shed_total{reason="queue-full"} 3.0' in text


async def test_prefill_queue_bound_answers_503(make) -> None:
    factory, http = make
    r = await factory(max_prefill_queue=1)
    hold = Hold(r.service)
    bodies = [{"user_id": f"p{i}", "long_term": rank_body(f"p{i}", i)["long_term"]} for i in range(3)]
    tasks = [asyncio.ensure_future(post(http, r.url + "/v1/prefill", b)) for b in bodies]
    await until(lambda: sum(t.done() for t in tasks) >= 1, "a prefill refused")
    await hold.release()
    statuses = sorted(s for s, _, _ in await asyncio.gather(*tasks))
    assert 503 in statuses and 200 in statuses


async def test_expired_deadline_is_dropped_before_compute(make) -> None:
    factory, http = make
    r = await factory()
    calls = count_calls(r.service)
    # already past on arrival
    status, body, headers = await post(http, r.url + "/v1/rank", rank_body("a", 1), {"X-Grstack-Deadline-Ms": "0"})
    assert status == 504 and "deadline" in body["error"] and headers["X-Grstack-Shed"] == "deadline"
    # expires while queued behind busy compute
    hold = Hold(r.service)
    filler = asyncio.ensure_future(post(http, r.url + "/v1/rank", rank_body("f", 9)))  # the one computing
    await until(lambda: sum(r.service.scheduler.depth().values()) == 0 and filler is not None, "filler popped")
    await asyncio.sleep(0.05)
    task = asyncio.ensure_future(post(http, r.url + "/v1/rank", rank_body("b", 2), {"X-Grstack-Deadline-Ms": "50"}))
    await asyncio.sleep(0.2)
    await hold.release()
    status, body, _ = await task
    assert status == 504 and "dropped before compute" in body["error"]
    assert (await filler)[0] == 200
    assert calls == {"rank_full": 1, "rank_cached": 0, "extend": 0}  # the filler only: b never computed
    assert r.service.scheduler.dropped_expired == 1
    # a generous deadline is served
    status, body, _ = await post(http, r.url + "/v1/rank", rank_body("c", 3), {"X-Grstack-Deadline-Ms": "30000"})
    assert status == 200 and calls["rank_full"] == 2
    status, body, _ = await post(http, r.url + "/v1/rank", rank_body("c", 3), {"X-Grstack-Deadline-Ms": "soon"})
    assert status == 400


async def test_rank_joins_the_in_flight_prefill_instead_of_recomputing(make) -> None:
    factory, http = make
    r = await factory(chunk=8)  # 30 tokens: one step (the 1,024-token step budget takes them whole)
    sched = r.service.scheduler
    calls = count_calls(r.service)
    body = rank_body("joiner", 7)
    hold = Hold(r.service)
    pre = asyncio.ensure_future(post(http, r.url + "/v1/prefill", {"user_id": "joiner",
                                                                  "long_term": body["long_term"]}))
    await until(lambda: bool(r.service._inflight_jobs), "the prefill is queued")
    rank = asyncio.ensure_future(post(http, r.url + "/v1/rank", body))
    # joining raises the prefill's priority: it moves to the rank queue
    await until(lambda: sched.depth()["prefills"] == 0 and sched.depth()["misses"] == 1, "the prefill is boosted")
    await asyncio.sleep(0.3)  # longer than the old 200 ms wait: the rank still does not recompute
    await hold.release()
    (ps, pb, _), (rs, rb, _) = await asyncio.gather(pre, rank)
    assert ps == 200 and pb["status"] == "computed"
    assert rs == 200 and rb["cache"] == "device"
    assert rb["joined_ms"] >= 300  # it waited for the held prefill, and says so
    assert calls["extend"] == 1 and calls["rank_full"] == 0 and calls["rank_cached"] == 1  # one prefill only
    text = await (await http.get(r.url + "/metrics")).text()
    assert 'grstack_ranker_cache_lookups_total{result="joined"} 1.0' in text


async def test_hit_rate_counts_rank_lookups_only_and_histograms(make) -> None:
    factory, http = make
    r = await factory()
    body = rank_body("h", 5)
    pre = {"user_id": "h", "long_term": body["long_term"]}
    assert (await post(http, r.url + "/v1/prefill", pre))[1]["status"] == "computed"
    assert (await post(http, r.url + "/v1/prefill", pre))[1]["status"] == "cached"  # a signal, not a hit
    stats = await (await http.get(r.url + "/v1/stats")).json()
    assert stats["device_hits"] == 0 and stats["dram_hits"] == 0 and stats["misses"] == 0
    hit = (await post(http, r.url + "/v1/rank", body))[1]
    assert hit["cache"] == "device" and hit["joined_ms"] == 0  # cached before the rank came: nothing joined
    assert (await post(http, r.url + "/v1/rank", {**body, "user_id": "other"}))[1]["cache"] == "miss"
    stats = await (await http.get(r.url + "/v1/stats")).json()
    assert stats["device_hits"] == 1 and stats["misses"] == 1
    text = await (await http.get(r.url + "/metrics")).text()
    assert 'grstack_ranker_prefill_seconds_count 1.0' in text
    assert 'grstack_ranker_queue_wait_seconds_count{kind="prefill"} 1.0' in text
    assert 'grstack_ranker_queue_wait_seconds_count{kind="hit"} 1.0' in text
    assert 'grstack_ranker_queue_wait_seconds_count{kind="miss"} 1.0' in text
    await http.post(r.url + "/v1/no/such/path/123")
    text = await (await http.get(r.url + "/metrics")).text()
    assert 'endpoint="unmatched"' in text and "/v1/no/such" not in text


async def test_a_rank_predicted_late_is_answered_503_at_once_and_joins_nothing(make) -> None:
    factory, http = make
    r = await factory(chunk=8, admission_margin_ms=5.0)
    sched = r.service.scheduler
    calls = count_calls(r.service)
    sched.token_cost = StepCost()  # as if measured: 10 ms a prefix token (chunks, full inference), 1 ms a rank
    sched.full_cost = StepCost()
    sched.hit_cost = StepCost()
    for n in range(1, 13):
        sched.token_cost.add(n, 0.010 * n)
        sched.full_cost.add(n, 0.010 * n)
        sched.hit_cost.add(n, 0.001 * n)
    hold = Hold(r.service)
    status, body, headers = await post(http, r.url + "/v1/rank", rank_body("late", 1), {"X-Grstack-Deadline-Ms": "100"})
    assert status == 503 and headers["X-Grstack-Shed"] == "predicted-late" and headers["Retry-After"] == "1"
    assert "after its deadline" in body["error"]
    # a rank that would join an in-flight prefill of 30 tokens (300 ms) is refused too, and boosts nothing
    prefill = rank_body("joiner", 2)
    pre = asyncio.ensure_future(post(http, r.url + "/v1/prefill", {"user_id": "joiner",
                                                                  "long_term": prefill["long_term"]}))
    await until(lambda: bool(r.service._inflight_jobs), "the prefill is queued")
    status, _, headers = await post(http, r.url + "/v1/rank", prefill, {"X-Grstack-Deadline-Ms": "100"})
    assert status == 503 and headers["X-Grstack-Shed"] == "predicted-late"
    assert sched.depth() == {"hits": 0, "misses": 0, "prefills": 1}  # still a background prefill
    # with time enough the same rank joins it
    rank = asyncio.ensure_future(post(http, r.url + "/v1/rank", prefill, {"X-Grstack-Deadline-Ms": "30000"}))
    await until(lambda: sched.depth()["misses"] == 1, "the prefill is boosted")
    await hold.release()
    (ps, _, _), (rs, rb, _) = await asyncio.gather(pre, rank)
    assert ps == 200 and rs == 200 and rb["cache"] == "device"
    assert calls["rank_full"] == 0  # the refused ranks computed nothing
    text = await (await http.get(r.url + "/metrics")).text()
    assert 'grstack_ranker_shed_total{reason="predicted-late"} 2.0' in text
