"""Property tests over the HTTP request schema of router and ranker (hypothesis): whatever the body and headers,
the answer is never a 500 and never carries a traceback; an error is one JSON object naming the problem."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grstack.runtime.serve.ranker import RankerConfig, RankerService, start_ranker
from grstack.runtime.serve.router import Router, RouterConfig, start_router

pytestmark = pytest.mark.integration

VALID_RANK = {"user_id": "u1", "long_term": {"items": [1, 2, 3], "timestamps": [10, 20, 30]},
              "short_term": {"items": [4], "timestamps": [40]}, "candidates": [5, 6, 7], "timestamp": 50}
VALID_PREFILL = {"user_id": "u1", "long_term": {"items": [1, 2, 3], "timestamps": [10, 20, 30]}}


@pytest.fixture(scope="module")
def servers(kit: SimpleNamespace) -> Iterator[SimpleNamespace]:
    """A ranker and a router in front of it, on an event loop of their own (hypothesis drives them from the
    test's thread with a blocking client)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def up() -> SimpleNamespace:
        service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8))
        r_runner, r_url = await start_ranker(service)
        router = Router(RouterConfig(rankers=(r_url,), startup_timeout_s=10.0, load_poll_interval_s=0))
        t_runner, t_url = await start_router(router)
        return SimpleNamespace(runners=[t_runner, r_runner], ranker=r_url, router=t_url)

    got = asyncio.run_coroutine_threadsafe(up(), loop).result(120)
    yield got

    async def down() -> None:
        for runner in got.runners:
            await runner.cleanup()

    asyncio.run_coroutine_threadsafe(down(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def send(url: str, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20)


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    """A valid body with some fields replaced, removed or added (nested ones too): near-misses that reach the
    validators and the handlers behind them."""
    body = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        if not body:
            break
        target = body
        key = draw(st.sampled_from(sorted(body)))
        if isinstance(body[key], dict) and draw(st.booleans()):
            target, key = body[key], draw(st.sampled_from([*sorted(body[key]), "actions", "extra"]))
        action = draw(st.sampled_from(["replace", "delete", "list-element"]))
        if action == "delete":
            target.pop(key, None)
        elif action == "list-element" and isinstance(target.get(key), list) and target[key]:
            target[key][draw(st.integers(0, len(target[key]) - 1))] = draw(json_values)
        else:
            target[key] = draw(json_values)
    if draw(st.booleans()):
        body[draw(st.text(max_size=8))] = draw(json_values)
    return body


header_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
bodies = st.one_of(
    mutated(VALID_RANK).map(lambda b: json.dumps(b).encode()),
    mutated(VALID_PREFILL).map(lambda b: json.dumps(b).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.just(json.dumps(VALID_RANK).encode()),
)
requests = st.fixed_dictionaries({
    "method": st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]),
    "path": st.sampled_from(["/v1/rank", "/v1/prefill", "/v1/rank", "/v1/stats", "/healthz", "/nope", "/v1/rank/"]),
    "body": bodies,
    "headers": st.dictionaries(st.sampled_from(["X-Grstack-Deadline-Ms", "Content-Type", "Authorization",
                                                "Accept", "X-Other"]), header_text, max_size=3),
})


def check(status: int, payload: bytes) -> None:
    assert status != 500, payload
    assert b"Traceback" not in payload and b'File "' not in payload, payload
    if status >= 400:
        err = json.loads(payload)
        assert isinstance(err, dict) and err["status"] == status and err["error"], payload


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(req=requests)
def test_ranker_never_500s(servers: SimpleNamespace, req: dict[str, Any]) -> None:
    check(*send(servers.ranker, req["method"], req["path"], req["body"], req["headers"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(req=requests)
def test_router_never_500s(servers: SimpleNamespace, req: dict[str, Any]) -> None:
    check(*send(servers.router, req["method"], req["path"], req["body"], req["headers"]))


def test_the_fixture_serves(servers: SimpleNamespace) -> None:
    """The properties above are not vacuous: a valid rank succeeds through both."""
    for url in (servers.ranker, servers.router):
        status, payload = send(url, "POST", "/v1/rank", json.dumps(VALID_RANK).encode(), {})
        assert status == 200 and len(json.loads(payload)["scores"]) == 3
