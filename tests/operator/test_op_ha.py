"""An operator that scales and fails over: leader election through kopf peering (who leads), readiness,
server-side label selectors, no periodic work for finished jobs, capped exponential backoff."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path
from typing import Any

import kopf
import pytest
from aiohttp import web
from opsim import Cluster

from grstack.operator import handlers, names
from grstack.operator.handlers import (
    OperatorConfig,
    build_registry,
    error_backoff,
    leads,
    next_wait,
    readiness,
)
from grstack.operator.kube import KubeClient

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def seen(seconds_ago: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds_ago)).isoformat()


@pytest.mark.unit
def test_backoff_is_exponential_and_capped() -> None:
    cfg = OperatorConfig(error_backoff_seconds=1, error_backoff_max_seconds=60)
    assert [error_backoff(cfg, n) for n in (1, 2, 3, 4, 6, 7, 50)] == [1, 2, 4, 8, 32, 60, 60]
    assert error_backoff(cfg, 3, jitter=1) == pytest.approx(4.8) and error_backoff(cfg, 3, -1) == pytest.approx(3.2)
    assert OperatorConfig().error_backoff_seconds < 5 < OperatorConfig().error_backoff_max_seconds


@pytest.mark.unit
@pytest.mark.parametrize(("peers", "expected"), [
    ({"me": {"priority": 9, "lastseen": seen(5), "lifetime": 60}}, True),
    ({"me": {"priority": 9, "lastseen": seen(5), "lifetime": 60},
      "other": {"priority": 3, "lastseen": seen(5), "lifetime": 60}}, True),
    ({"me": {"priority": 3, "lastseen": seen(5), "lifetime": 60},
      "other": {"priority": 9, "lastseen": seen(5), "lifetime": 60}}, False),
    ({"me": {"priority": 3, "lastseen": seen(5), "lifetime": 60},
      "other": {"priority": 9, "lastseen": seen(120), "lifetime": 60}}, True),  # the old leader died
    ({"me": {"priority": 5, "lastseen": seen(5), "lifetime": 60},
      "other": {"priority": 5, "lastseen": seen(5), "lifetime": 60}}, False),  # a tie pauses both
    ({"other": {"priority": 1, "lastseen": seen(5), "lifetime": 60}}, False),  # not registered yet
])
def test_who_leads(peers: dict[str, Any], expected: bool) -> None:
    assert leads(peers, "me", NOW) is expected


@pytest.mark.unit
def test_finished_jobs_get_no_periodic_passes() -> None:
    _, rt = build_registry(OperatorConfig(resync_seconds=10))
    rt.metrics.job_state(("ns", "done"), "Succeeded")
    rt.metrics.job_state(("ns", "failed"), "Failed")
    rt.metrics.job_state(("ns", "running"), "Running")
    assert next_wait(rt, "GRTrainingJob", "ns", "done", None) is None  # until an event wakes it
    assert next_wait(rt, "GRTrainingJob", "ns", "failed", None) is None
    assert next_wait(rt, "GRTrainingJob", "ns", "done", 30.0) == 10  # a TTL deadline still brings it back
    assert next_wait(rt, "GRTrainingJob", "ns", "running", None) == 10
    assert next_wait(rt, "GRRankingService", "ns", "svc", None) == 10


@pytest.mark.unit
async def test_sleep_without_timeout_ends_on_a_wakeup() -> None:
    _, rt = build_registry()
    key = ("GRTrainingJob", "ns", "done")
    sleeper = asyncio.create_task(rt.sleep(key, None))
    await asyncio.sleep(0.1)
    assert not sleeper.done()
    rt.wake(key)
    await asyncio.wait_for(sleeper, 2)


def _startup(registry: kopf.OperatorRegistry, name: str) -> Any:
    return next(h.fn for h in registry._activities.get_all_handlers() if str(h.id).endswith(name))


@pytest.mark.unit
def test_server_side_selectors_and_peering_settings() -> None:
    registry, _ = build_registry(OperatorConfig(peering="grstack", priority=42, peering_lifetime_s=15))
    settings = kopf.OperatorSettings()
    _startup(registry, "configure")(settings=settings)
    selectors = {sel.any_name: value for sel, value in settings.watching.label_selectors.items()}
    assert selectors == {"pods": names.LABEL_JOB, "statefulsets": names.LABEL_SERVICE,
                         "deployments": names.LABEL_SERVICE}
    assert (settings.peering.name, settings.peering.priority, settings.peering.standalone,
            settings.peering.clusterwide, settings.peering.lifetime) == ("grstack", 42, False, True, 15)
    standalone, _ = build_registry(OperatorConfig())
    plain = kopf.OperatorSettings()
    _startup(standalone, "configure")(settings=plain)
    assert plain.peering.name == "default"  # untouched: the CLI runs it standalone


@pytest.mark.integration
async def test_readiness_against_the_emulator(tmp_path: Path) -> None:
    async with Cluster.start(tmp_path) as cluster:
        _, rt = build_registry(OperatorConfig(server=cluster.url))
        assert (await readiness(rt))[0] is False  # not logged in
        rt.client = KubeClient(cluster.url)
        ok, body = await readiness(rt)
        assert ok and body == {"crds": True}
        # With peering: ready either way; the body says who leads.
        rt.config.peering, rt.identity = "grstack", "me"

        async def peering(_: web.Request) -> web.Response:
            return web.json_response({"status": {"me": {"priority": 1, "lastseen": dt.datetime.now(dt.UTC)
                                                        .isoformat(), "lifetime": 60}}})

        app = web.Application()
        app.router.add_get("/apis/kopf.dev/v1/clusterkopfpeerings/grstack", peering)
        async def group(_: web.Request) -> web.Response:
            return web.json_response({"resources": [{"name": names.TRAINING_PLURAL}, {"name": names.SERVING_PLURAL}]})

        app.router.add_get(f"/apis/{names.GROUP}/{names.VERSION}", group)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await rt.client.close()
        rt.client = KubeClient(f"http://127.0.0.1:{port}")
        ok, body = await readiness(rt)
        assert ok and body["leader"] is True and rt.metrics.leader._value.get() == 1
        # The HTTP endpoint.
        server = await handlers.start_readiness_server(rt, 0, "127.0.0.1")
        assert server.addresses
        await server.cleanup()
        await rt.client.close()
        await runner.cleanup()
