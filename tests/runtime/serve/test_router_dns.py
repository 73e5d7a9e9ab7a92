"""Ranker discovery through DNS (a headless Service) and budgets that follow the ranker count: what lets the
operator keep the ranker count out of the router's pod template."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from grstack.runtime.cli_args import ArgParser
from grstack.runtime.errors import UserError
from grstack.runtime.serve.cli import register, router_config
from grstack.runtime.serve.router import Router, RouterConfig
from grstack.runtime.serve.trigger import SequenceAwareTrigger, TriggerConfig

pytestmark = pytest.mark.unit


def fake_dns(monkeypatch: pytest.MonkeyPatch, router: Router, answers: list[Any]) -> None:
    async def getaddrinfo(host: str, port: int, **_: Any) -> list[Any]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, port) if ":" not in ip else (ip, port, 0, 0)) for ip in answer]

    import asyncio
    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)


async def test_rankers_follow_the_service_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    router = Router(RouterConfig(rankers_dns="rank-ranker:8000"))
    fake_dns(monkeypatch, router, [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3", "fd00::4"],
                                   socket.gaierror("temporary failure"), []])
    await router.resolve_rankers()
    assert sorted(await router.store.replicas()) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    await router.resolve_rankers()  # scaled: one gone, two new
    assert sorted(await router.store.replicas()) == ["http://10.0.0.2:8000", "http://10.0.0.3:8000",
                                                     "http://[fd00::4]:8000"]
    await router.resolve_rankers()  # a failed lookup keeps the view
    assert len(await router.store.replicas()) == 3
    await router.resolve_rankers()  # no ready ranker left
    assert await router.store.replicas() == {}
    await router.store.close()


def test_cache_budget_per_replica_follows_the_up_rankers() -> None:
    router = Router(RouterConfig(cache_budget_per_replica_bytes=100, prefill_budget_per_replica_ms=10))
    router.trigger = SequenceAwareTrigger.__new__(SequenceAwareTrigger)
    router.trigger.config = TriggerConfig(cache_budget_bytes=1)
    router.replicas = {f"r{i}": None for i in range(3)}  # type: ignore[misc]
    router._update_budget()
    assert router.trigger.config.cache_budget_bytes == 300
    router.down = {"r0"}
    router._update_budget()
    assert router.trigger.config.cache_budget_bytes == 200


def test_cli_flags() -> None:
    parser = ArgParser()
    register(parser)
    args = parser.parse_args(["router", "--rankers-dns", "rank-ranker:8000", "--cache-budget-per-replica-mb", "2"])
    cfg = router_config(args)
    assert cfg.rankers_dns == "rank-ranker:8000" and cfg.cache_budget_per_replica_bytes == 2 << 20
    with pytest.raises(UserError, match="not allowed with"):
        parser.parse_args(["router", "--rankers-dns", "a:1", "--rankers", "http://x:1"])
    with pytest.raises(UserError, match="HOST:PORT"):
        parser.parse_args(["router", "--rankers-dns", "no-port"])
