"""The router's retry budget, outlier ejection and load-capped affinity (no network: the router's view only)."""

from __future__ import annotations

import asyncio

import pytest

from grstack.runtime.serve.placement import Event, Replica
from grstack.runtime.serve.router import RetryBudget, Router, RouterConfig

pytestmark = pytest.mark.unit


def test_retry_budget_caps_retries_over_the_window() -> None:
    now = [0.0]
    budget = RetryBudget(ratio=0.1, minimum=0, window_s=10.0, clock=lambda: now[0])
    for _ in range(20):
        budget.request()
    allowed = sum(budget.try_retry() for _ in range(10))
    assert allowed == 2  # 10% of 20 requests
    now[0] = 11.0  # the window slides: the old requests and retries are gone
    budget.request()
    assert not budget.try_retry()  # 10% of 1 request is less than one retry
    assert RetryBudget(0.0, 3, 10.0).try_retry()  # the minimum allows a few at low traffic


async def test_one_timeout_does_not_eject_consecutive_failures_do_and_it_returns() -> None:
    router = Router(RouterConfig(outlier_consecutive_failures=3, outlier_base_ejection_s=0.2,
                                 outlier_latency_factor=None))
    router.apply(Event("snapshot", replicas=[Replica("a", "http://a"), Replica("b", "http://b")], placements=[]))
    router.record_failure("a")
    assert "a" in router.up_replicas() and not router.ejected
    router.record_success("a", 0.01)  # a success resets the count
    router.record_failure("a")
    router.record_failure("a")
    assert "a" in router.up_replicas()
    router.record_failure("a")
    assert router.up_replicas() == ["b"] and "a" in router.ejected
    router.record_failure("b")
    router.record_failure("b")
    router.record_failure("b")
    assert "b" not in router.ejected  # never more than half the replicas ejected
    await asyncio.sleep(0.25)
    order, _ = router.route("user")
    assert "a" in order and not router.ejected  # back after the backoff


async def test_latency_outlier_is_ejected() -> None:
    router = Router(RouterConfig(outlier_latency_min_samples=5, outlier_latency_factor=3.0,
                                 outlier_latency_floor_ms=1.0, outlier_latency_min_hosts=2))
    router.apply(Event("snapshot", replicas=[Replica("a", "http://a"), Replica("b", "http://b")], placements=[]))
    for _ in range(5):
        router.record_success("b", 0.005)
    for _ in range(5):
        router.record_success("a", 0.1)
    assert "a" in router.ejected


@pytest.mark.parametrize("replicas", [2, 4])
async def test_too_few_replicas_for_latency_outliers_eject_none_by_latency(replicas: int) -> None:
    """Envoy's minimum hosts: below 5 replicas one slow replica is as likely the busy users' as faulty."""
    router = Router(RouterConfig(outlier_latency_min_samples=5, outlier_latency_factor=3.0,
                                 outlier_latency_floor_ms=1.0))
    names = [chr(ord("a") + i) for i in range(replicas)]
    router.apply(Event("snapshot", replicas=[Replica(r, f"http://{r}") for r in names], placements=[]))
    for r in names[1:]:
        for _ in range(5):
            router.record_success(r, 0.005)
    for _ in range(5):
        router.record_success("a", 0.1)
    assert not router.ejected
    router.apply(Event("snapshot", replicas=[Replica(r, f"http://{r}") for r in [*names, "x", "y", "z"][:5]],
                       placements=[]))
    for r in [*names, "x", "y", "z"][replicas:5]:
        for _ in range(5):
            router.record_success(r, 0.005)
    router.record_success("a", 0.1)  # five replicas with samples: now the slow one is an outlier
    assert "a" in router.ejected


def test_ejection_time_grows_with_recent_ejections_and_decays_while_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    from grstack.runtime.serve import router as router_module

    now = [100.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: now[0])
    router = Router(RouterConfig(outlier_consecutive_failures=1, outlier_base_ejection_s=5.0,
                                 outlier_latency_factor=None))
    router.apply(Event("snapshot", replicas=[Replica("a", "http://a"), Replica("b", "http://b")], placements=[]))

    def eject() -> float:
        router.record_failure("a")
        period = router.ejected["a"] - now[0]
        now[0] += period
        router._release_ejections()
        assert "a" not in router.ejected
        return period

    assert eject() == 5.0
    assert eject() == 10.0  # ejected again at once: twice as long
    now[0] += 10.0  # healthy for two base periods: the count drops by two
    assert eject() == 5.0
    now[0] += 4.0  # under one base period: no drop
    assert eject() == 10.0


def test_without_affinity_routes_ignore_placements_and_spread_over_replicas() -> None:
    from grstack.runtime.serve.placement import Placement

    replicas = [Replica(r, f"http://{r}") for r in ("a", "b", "c")]
    placed = [Placement("user", "a", "v", 1)]
    pinned = Router(RouterConfig())
    pinned.apply(Event("snapshot", replicas=replicas, placements=placed))
    assert {pinned.route("user")[0][0] for _ in range(30)} == {"a"}
    spread = Router(RouterConfig(affinity=False))
    spread.apply(Event("snapshot", replicas=replicas, placements=placed))
    firsts = set()
    for _ in range(60):
        order, kind = spread.route("user")
        assert kind == "random" and len(set(order)) == len(order) == 3
        firsts.add(order[0])
    assert firsts == {"a", "b", "c"}  # 60 draws miss a replica with probability about 3 * (2/3)**60


def test_a_placed_user_leaves_a_replica_with_too_many_requests_in_flight() -> None:
    from grstack.runtime.serve.placement import Placement

    router = Router(RouterConfig(load_factor=1.25, overload_min_load=4))
    router.apply(Event("snapshot", replicas=[Replica(r, f"http://{r}") for r in ("a", "b", "c")],
                       placements=[Placement("user", "a", "v", 1)]))
    router.inflight = {"a": 3, "b": 0, "c": 0}  # far over the mean, but under the minimum: affinity holds
    assert router.route("user") == (["a", *[r for r in router.ring.order("user") if r != "a"]][:3], "affinity")
    router.inflight["a"] = 4
    order, kind = router.route("user")
    assert kind == "moved" and order[0] in {"b", "c"} and "a" in order[1:]
    router.inflight = {"a": 4, "b": 3, "c": 3}  # 4 is not over 1.25 x the mean of 10/3
    assert router.route("user")[1] == "affinity"
    router.inflight = {"a": 0}
    router.queued = {"a": 9}  # the queue the ranker reports counts as well (other routers' requests)
    assert router.route("user")[1] == "moved"
