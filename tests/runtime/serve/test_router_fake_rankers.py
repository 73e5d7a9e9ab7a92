"""The router over HTTP against fake rankers whose answers and ``/v1/stats`` the tests control: per-ranker
trigger budgets shared by two routers, a recomputed live prefix charged, users moved off an overloaded
replica, and overload behaviour (timeouts, outlier ejection, queue-full 503s, deadlines, the retry budget)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from grstack.runtime.serve.http import start_site
from grstack.runtime.serve.router import DEADLINE_HEADER, Router, RouterConfig, start_router
from grstack.runtime.serve.trigger import TriggerConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PREFILL_MS = 10.0  # the fake's profile: every prefill predicted at 10 ms


class FakeRanker:
    """A ranker app with controllable behaviour; it records what reached it."""

    def __init__(self) -> None:
        self.url = ""
        self.runner: web.AppRunner | None = None
        self.rank_delay_s = 0.0
        self.rank_status = 200
        self.rank_headers: dict[str, str] = {}
        self.prefill_status = "computed"
        self.report_compute = True  # False: a ranker that reports no compute_ms_total (today's rankers)
        self.accumulate = True  # prefills received stay in the reported prefill backlog
        self.queued = 0  # ranks waiting (reported as queued cached ranks)
        self.queued_prefills = 0  # prefills waiting besides the received ones, when ``accumulate``
        self.prefills: list[dict] = []
        self.ranks: list[dict[str, str]] = []  # headers of each rank received

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"replica": self.url, "device_hits": 0, "dram_hits": 0, "misses": 0, "promotions": 0,
                               "device_bytes": 0, "dram_bytes": 0, "device_entries": 0, "dram_entries": 0,
                               "prefills_computed": 0, "ranks": len(self.ranks),
                               "queued": self.queued + self.queued_prefills}  # every queue, as a ranker reports
        if self.report_compute:
            backlog = len(self.prefills) if self.accumulate else 0
            out.update(compute_ms_total={"prefill": 0.0, "rank_cached": 0.0, "rank_full": 0.0},
                       queue_depth={"hits": self.queued, "misses": 0, "prefills": backlog + self.queued_prefills},
                       prefill_backlog_tokens=sum(len(p["long_term"]["items"]) for p in self.prefills[:backlog]))
        return out

    def app(self) -> web.Application:
        async def readyz(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "detail": {}})

        async def profile(_: web.Request) -> web.Response:
            return web.json_response({"replica": self.url, "max_len": 48, "max_suffix": 8, "max_candidates": 64,
                                      "candidates": 4, "lengths": [8, 64], "full_ms": [8.0, 64.0],
                                      "cached_ms": [1.0, 1.0], "prefill_ms": [PREFILL_MS, PREFILL_MS],
                                      "kv_bytes_per_token": 100, "tasks": ["click"], "num_items": 300})

        async def stats(_: web.Request) -> web.Response:
            return web.json_response(self.stats())

        async def prefill(request: web.Request) -> web.Response:
            body = await request.json()
            self.prefills.append(body)
            n = len(body["long_term"]["items"])
            return web.json_response({"user_id": body["user_id"], "replica": self.url, "prefix_hash": "h",
                                      "prefix_len": n, "status": self.prefill_status, "kv_bytes": 100 * n,
                                      "compute_ms": PREFILL_MS})

        async def rank(request: web.Request) -> web.Response:
            body = await request.json()
            self.ranks.append(dict(request.headers))
            if self.rank_delay_s:
                await asyncio.sleep(self.rank_delay_s)
            if self.rank_status != 200:
                return web.json_response({"error": "fake", "status": self.rank_status}, status=self.rank_status,
                                         headers=self.rank_headers)
            return web.json_response({"user_id": body["user_id"], "replica": self.url, "scores": [[0.0]]})

        app = web.Application()
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/v1/profile", profile)
        app.router.add_get("/v1/stats", stats)
        app.router.add_post("/v1/prefill", prefill)
        app.router.add_post("/v1/rank", rank)
        return app

    async def start(self) -> FakeRanker:
        self.runner, self.url = await start_site(self.app(), "127.0.0.1", 0)
        return self


def rank_body(user: str, seed: int = 0, n_long: int = 30) -> dict:
    rng = np.random.default_rng(seed)
    n = n_long + 4
    items = rng.integers(1, 301, n).tolist()
    ts = (1_600_000_000 + np.cumsum(rng.integers(1, 999, n))).tolist()
    return {"user_id": user, "long_term": {"items": items[:n_long], "timestamps": ts[:n_long]},
            "short_term": {"items": items[n_long:], "timestamps": ts[n_long:]}, "candidates": [5, 7],
            "timestamp": ts[-1] + 5}


def prefill_body(user: str, seed: int = 0) -> dict:
    return {"user_id": user, "long_term": rank_body(user, seed)["long_term"], "wait": True}


async def post(http: aiohttp.ClientSession, url: str, body: dict,
               headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    async with http.post(url, data=json.dumps(body).encode(), headers=headers,
                         timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def config(**kw: Any) -> RouterConfig:
    base: dict[str, Any] = {"trigger": TriggerConfig(length_threshold=16), "health_interval_s": 0.3,
                            "startup_timeout_s": 5, "load_poll_interval_s": 0, "outlier_latency_factor": None}
    return RouterConfig(**{**base, **kw})


class Setup:
    def __init__(self, n_rankers: int, n_routers: int = 1, **cfg: Any) -> None:
        self.n_rankers, self.n_routers, self.cfg = n_rankers, n_routers, cfg

    async def __aenter__(self) -> Setup:
        self.fakes = [await FakeRanker().start() for _ in range(self.n_rankers)]
        self.routers: list[Router] = []
        self.urls: list[str] = []
        self._runners = []
        for _ in range(self.n_routers):
            router = Router(config(rankers=tuple(f.url for f in self.fakes), **self.cfg))
            runner, url = await start_router(router)
            self.routers.append(router)
            self.urls.append(url)
            self._runners.append(runner)
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.http.close()
        for runner in self._runners:
            await runner.cleanup()
        for f in self.fakes:
            assert f.runner is not None
            await f.runner.cleanup()

    def user_first_on(self, fake: FakeRanker, prefix: str = "u") -> str:
        ring = self.routers[0].ring
        return next(f"{prefix}{i}" for i in range(10_000) if ring.order(f"{prefix}{i}")[0] == fake.url)

    async def poll(self) -> None:
        for router in self.routers:
            await router.poll_load()


# -- per-ranker budgets --------------------------------------------------------------------------------
@pytest.mark.parametrize(("report_compute", "expected"), [(True, 5), (False, 10)])
async def test_two_routers_stay_within_one_rankers_prefill_budget(report_compute: bool, expected: int) -> None:
    """5 ms/s x 10 s = 50 ms per ranker, 10 ms per prefill: the ranker's backlog (fed by both routers) stops
    both at 5 together; a ranker that reports no compute leaves each router its own budget (10 together)."""
    async with Setup(1, n_routers=2, prefill_budget_per_replica_ms=5.0) as s:
        (fake,) = s.fakes
        fake.report_compute = report_compute
        admitted = 0
        for i in range(14):
            await s.poll()
            status, out, _ = await post(s.http, s.urls[i % 2] + "/v1/prefill", prefill_body(f"u{i}", i))
            assert status == 200
            admitted += out["admitted"]
            if not out["admitted"]:
                assert out["reason"] == "load-budget"
        assert admitted == len(fake.prefills) == expected


@pytest.mark.parametrize(("ranks_follow", "expected"), [(True, 14), (False, 5)])
async def test_prefills_whose_ranks_follow_are_not_refused_for_load(ranks_follow: bool, expected: int) -> None:
    """50 ms of prefill budget, 10 ms a prefill: 5 admissions when no rank follows its signal; when every rank
    follows, the prefills replace the ranks' full inference, charge nothing once 4 outcomes are known, and all
    14 are admitted (the router's gauge says what share it still charges)."""
    trig = TriggerConfig(length_threshold=16, follow_window=8, follow_min_samples=4)
    async with Setup(1, prefill_budget_per_replica_ms=5.0, trigger=trig) as s:
        (fake,) = s.fakes
        admitted = 0
        for i in range(14):
            status, out, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body(f"u{i}", i))
            assert status == 200 and (out["admitted"] or out["reason"] == "load-budget")
            admitted += out["admitted"]
            if ranks_follow:
                status, _, _ = await post(s.http, s.urls[0] + "/v1/rank", rank_body(f"u{i}", i))
                assert status == 200
        assert admitted == len(fake.prefills) == expected
        async with s.http.get(s.urls[0] + "/metrics") as resp:
            share = 0.0 if ranks_follow else 1.0
            assert f"grstack_router_trigger_speculative_share {share}" in await resp.text()


@pytest.mark.parametrize(("ranker_status", "pending"), [("computed", 2 * PREFILL_MS), ("cached", PREFILL_MS)])
async def test_a_live_resignal_the_ranker_recomputed_is_charged(ranker_status: str, pending: float) -> None:
    async with Setup(1) as s:
        (fake,) = s.fakes
        fake.accumulate = False
        await s.poll()
        router = s.routers[0]
        status, first, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body("u", 1))
        assert status == 200 and first["reason"] == "admitted"
        fake.prefill_status = ranker_status  # "computed": the ranker had evicted the prefix
        status, again, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body("u", 1))
        assert status == 200 and again["reason"] == "live" and again["ranker"]["status"] == ranker_status
        assert router.trigger is not None
        assert router.trigger.pending_ms(fake.url) == pending
        assert router.trigger.replica_bytes(fake.url) == 30 * 100  # the bytes are held once


async def test_a_routed_rank_releases_its_prefixs_footprint() -> None:
    async with Setup(1) as s:
        await s.poll()
        router = s.routers[0]
        assert router.trigger is not None
        status, first, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body("u", 1))
        assert status == 200 and first["reason"] == "admitted" and router.trigger.live_bytes == 30 * 100
        status, _, _ = await post(s.http, s.urls[0] + "/v1/rank", rank_body("u", 1))
        assert status == 200 and router.trigger.live_bytes == 0


# -- moving users off an overloaded replica --------------------------------------------------------
async def test_a_placed_user_moves_off_a_replica_over_its_load_cap() -> None:
    async with Setup(2, overload_min_load=4) as s:
        a, b = s.fakes
        router = s.routers[0]
        user = s.user_first_on(a)
        await s.poll()
        status, pre, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body(user, 1))
        assert status == 200 and pre["replica"] == a.url
        a.queued = 3  # over the mean, but short: affinity holds
        await s.poll()
        status, out, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(user, 1))
        assert status == 200 and out["replica"] == a.url and headers["X-Grstack-Route"] == "affinity"
        a.queued = 10  # over the cap, but 10 cached ranks (1 ms each) wait less than the 30 ms recompute elsewhere
        await s.poll()
        status, out, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(user, 1))
        assert status == 200 and out["replica"] == a.url and headers["X-Grstack-Route"] == "affinity"
        a.queued = 40  # 40 ms of queue: computing the 30-event prefix elsewhere is sooner
        await s.poll()
        status, out, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(user, 1))
        assert status == 200 and out["replica"] == b.url and headers["X-Grstack-Route"] == "moved"
        status, pre, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body(user, 2))  # a new prefix
        assert status == 200 and pre["admitted"] and pre["replica"] == b.url
        assert router.placements[user].replica == b.url and router.placements[user].revision > 0  # in the store
        a.queued = 0
        await s.poll()
        status, out, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(user, 2))
        assert out["replica"] == b.url and headers["X-Grstack-Route"] == "affinity"  # it stays where it moved


async def test_queued_prefills_do_not_move_a_user_off_its_prefix() -> None:
    """Prefills are background work: a long prefill queue on the placed replica is no reason to send the rank to
    a replica that would have to compute the whole prefix."""
    async with Setup(2, overload_min_load=4) as s:
        a, _ = s.fakes
        user = s.user_first_on(a)
        await s.poll()
        status, pre, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body(user, 1))
        assert status == 200 and pre["replica"] == a.url
        a.queued_prefills = 40
        await s.poll()
        assert s.routers[0].load_view()[a.url] == 0
        status, out, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(user, 1))
        assert status == 200 and out["replica"] == a.url and headers["X-Grstack-Route"] == "affinity"


async def test_a_prefill_moves_when_its_replicas_budget_is_spent() -> None:
    async with Setup(2, prefill_budget_per_replica_ms=5.0) as s:
        a, b = s.fakes
        router = s.routers[0]
        user = s.user_first_on(a)
        await s.poll()
        status, pre, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body(user, 1))
        assert status == 200 and pre["replica"] == a.url
        a.prefills.extend([prefill_body("other", 9)] * 10)  # 100 ms of a's prefill queue: over its 50 ms
        await s.poll()
        status, pre, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body(user, 2))
        assert status == 200 and pre["admitted"] and pre["replica"] == b.url
        assert router.placements[user].replica == b.url
        b.prefills.extend([prefill_body("other", 9)] * 10)  # both spent: refused, not moved
        await s.poll()
        status, pre, _ = await post(s.http, s.urls[0] + "/v1/prefill", prefill_body(user, 3))
        assert status == 200 and not pre["admitted"] and pre["reason"] == "load-budget"


# -- overload over HTTP ------------------------------------------------------------------------------
async def test_a_slow_ranker_times_out_retries_elsewhere_and_is_ejected_after_consecutive_failures() -> None:
    async with Setup(2, rank_timeout_s=0.2, rank_budget_ms=3000, outlier_consecutive_failures=3,
                     retry_budget_min=100) as s:
        slow, fast = s.fakes
        slow.rank_delay_s = 2.0
        router = s.routers[0]
        users = [s.user_first_on(slow, f"s{i}-") for i in range(4)]
        status, out, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(users[0]))
        assert status == 200 and out["replica"] == fast.url and headers["X-Grstack-Attempts"] == "2"
        assert slow.url not in router.ejected  # one timeout ejects nothing
        for user in users[1:3]:
            status, out, _ = await post(s.http, s.urls[0] + "/v1/rank", rank_body(user))
            assert status == 200 and out["replica"] == fast.url
        assert slow.url in router.ejected
        status, out, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(users[3]))
        assert status == 200 and headers["X-Grstack-Attempts"] == "1" and len(slow.ranks) == 3


@pytest.mark.parametrize("reason", ["queue-full", "predicted-late"])
async def test_a_ranker_refusal_everywhere_is_a_503_with_retry_after_after_trying_the_others(reason: str) -> None:
    async with Setup(2, outlier_consecutive_failures=1) as s:
        a, b = s.fakes
        for f in s.fakes:
            f.rank_status = 503
            f.rank_headers = {"Retry-After": "3", "X-Grstack-Shed": reason}
        user = s.user_first_on(a)
        status, err, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(user))
        assert status == 503 and headers["Retry-After"] == "3" and headers["X-Grstack-Shed"] == reason
        assert reason in err["error"] and len(a.ranks) == len(b.ranks) == 1
        assert not s.routers[0].ejected  # overload is not a fault
        b.rank_status = 200
        status, out, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(user))
        assert status == 200 and out["replica"] == b.url and headers["X-Grstack-Attempts"] == "2"


async def test_a_client_deadline_only_shortens_the_budget_and_reaches_the_ranker() -> None:
    async with Setup(1, rank_budget_ms=2000) as s:
        (fake,) = s.fakes
        for sent, most in (("150", 150.0), ("60000", 2000.0), (None, 2000.0)):
            headers = {DEADLINE_HEADER: sent} if sent is not None else None
            status, _, _ = await post(s.http, s.urls[0] + "/v1/rank", rank_body("u"), headers)
            assert status == 200
            got = float(fake.ranks[-1][DEADLINE_HEADER])
            assert 0.5 * most < got <= most
        status, err, _ = await post(s.http, s.urls[0] + "/v1/rank", rank_body("u"), {DEADLINE_HEADER: "soon"})
        assert status == 400 and DEADLINE_HEADER in err["error"]


async def test_no_retries_once_the_retry_budget_is_spent() -> None:
    async with Setup(3, retry_budget_ratio=0.0, retry_budget_min=1, outlier_consecutive_failures=100) as s:
        for f in s.fakes:
            f.rank_status = 500
        status, err, _ = await post(s.http, s.urls[0] + "/v1/rank", rank_body("u"))
        assert status == 503 and sum(len(f.ranks) for f in s.fakes) == 2  # one retry, then the budget is spent
        status, err, _ = await post(s.http, s.urls[0] + "/v1/rank", rank_body("v"))
        assert status == 503 and "retry budget exhausted" in err["error"]
        assert sum(len(f.ranks) for f in s.fakes) == 3
        async with s.http.get(s.urls[0] + "/metrics") as resp:
            assert "grstack_router_retries_denied_total 2.0" in await resp.text()


async def test_a_try_cut_at_the_deadline_is_shed_with_504_not_counted_as_a_failure() -> None:
    async with Setup(2, rank_timeout_s=5.0, rank_budget_ms=150, outlier_consecutive_failures=2,
                     outlier_latency_min_samples=3, outlier_latency_factor=3.0, outlier_latency_floor_ms=1.0,
                     outlier_latency_min_hosts=2,
                     retry_budget_min=100) as s:
        slow, fast = s.fakes
        slow.rank_delay_s = 1.0
        router = s.routers[0]
        users = [s.user_first_on(slow, f"d{i}-") for i in range(3)]
        for user in users[:2]:  # under load every replica may be late: shed, never retried, nothing ejected
            status, err, headers = await post(s.http, s.urls[0] + "/v1/rank", rank_body(user))
            assert status == 504 and headers["X-Grstack-Shed"] == "deadline" and "deadline" in err["error"]
            assert headers["X-Grstack-Attempts"] == "1" and not fast.ranks
        assert not router.ejected  # two consecutive late tries are not two failures
        for _ in range(3):  # the other replica answers fast: the late one is now a latency outlier
            router.record_success(fast.url, 0.002)
        status, _, _ = await post(s.http, s.urls[0] + "/v1/rank", rank_body(users[2]))
        assert status == 504 and slow.url in router.ejected
