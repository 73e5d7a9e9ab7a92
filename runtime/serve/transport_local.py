"""A :class:`~grstack.runtime.serve.transport.RankerTransport` that calls :class:`RankerService` objects in this
process: the router and its rankers on one event loop with no sockets, so that a test (and a simulator) runs
the real control plane end to end. Answers are the ones the ranker's HTTP app gives for the same calls (status,
``X-Grstack-Shed``, ``Retry-After``); a URL with no service behind it is :class:`Unreachable`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel

from grstack.runtime.serve.clock import Now, SystemClock, wait_for
from grstack.runtime.serve.http import (
    DEADLINE_HEADER,
    RANKER_MS_HEADER,
    RequestError,
    parse_deadline_ms,
    parse_json,
)
from grstack.runtime.serve.scheduler import DeadlineExceeded, QueueFull
from grstack.runtime.serve.schemas import ErrorResponse, Health, PrefillRequest, RankRequest
from grstack.runtime.serve.step_log import RequestCpu
from grstack.runtime.serve.transport import Reply, Unreachable

if TYPE_CHECKING:
    from grstack.runtime.serve.ranker import RankerService

JSON = {"Content-Type": "application/json"}
M = TypeVar("M", bound=BaseModel)


def _model(model: BaseModel, status: int = 200) -> Reply:
    return Reply(status, model.model_dump_json().encode(), JSON)


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(status, ErrorResponse(error=message, status=status).model_dump_json().encode(),
                 {**JSON, **(headers or {})})


class InProcessTransport:
    """``services``: URL -> the ranker behind it (add or drop entries to bring replicas up or take them down);
    ``clock``: what a request's timeout counts (the system's when None; the rankers' own in a simulation)."""

    def __init__(self, services: Mapping[str, RankerService] | None = None, clock: Now | None = None) -> None:
        self.services: dict[str, RankerService] = dict(services or {})
        self.clock: Now = clock if clock is not None else SystemClock()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def parse(self, body: bytes, model: type[M]) -> M:
        """A request body as ``model``, as the HTTP app parses it (a simulator that built the request already
        returns it)."""
        return parse_json(body, model)

    def _service(self, url: str) -> RankerService:
        service = self.services.get(url)
        if service is None:
            raise Unreachable("ConnectionRefused", f"no ranker at {url}")
        return service

    async def post(self, url: str, path: str, body: bytes, timeout_s: float,
                   headers: Mapping[str, str] | None = None) -> Reply:
        service = self._service(url)
        if path == "/v1/rank":
            return await self._bounded(self._rank(service, body, dict(headers or {})), timeout_s)
        if path == "/v1/prefill":
            return await self._bounded(self._prefill(service, body), timeout_s)
        return _error(404, "Not Found")

    async def get(self, url: str, path: str, timeout_s: float) -> Reply:
        service = self._service(url)
        detail = {"replica": service.replica_id}
        if path == "/readyz":
            return _model(Health(status="ok" if service.ready else "starting", detail=detail),
                          200 if service.ready else 503)
        if path == "/healthz":
            return _model(Health(status="ok", detail=detail))
        if path == "/v1/profile":
            if service.profile is None:
                return _model(Health(status="starting"), 503)
            return _model(service.profile)
        if path == "/v1/stats":
            return _model(service.stats())
        if urlsplit(path).path == "/v1/steps":
            query = parse_qs(urlsplit(path).query)
            try:
                since = [int(query.get(k, ["0"])[0]) for k in ("since", "requests_since")]
            except ValueError:
                return _error(422, "since, requests_since: expected record numbers")
            return _model(service.steps_since(*since))
        return _error(404, "Not Found")

    async def _bounded(self, call: Awaitable[Reply], timeout_s: float) -> Reply:
        """The ranker's answer, its overload and deadline refusals as the HTTP app words them."""
        try:
            return await wait_for(self.clock, call, timeout_s)
        except RequestError as exc:
            return _error(exc.status, exc.message)
        except QueueFull as exc:
            retry = max(1, round(exc.retry_after_s))
            return _error(503, f"overloaded: {exc}; retry after {retry} s",
                          {"Retry-After": str(retry), "X-Grstack-Shed": exc.reason})
        except DeadlineExceeded as exc:
            return _error(504, f"deadline exceeded: {exc}", {"X-Grstack-Shed": "deadline"})

    async def _rank(self, service: RankerService, body: bytes, headers: dict[str, str]) -> Reply:
        arrived = service.scheduler.clock()
        if not service.ready:
            raise RequestError(503, "ranker is starting")
        budget_ms = parse_deadline_ms(headers.get(DEADLINE_HEADER))
        deadline = None if budget_ms is None else arrived + budget_ms / 1e3
        cpu = RequestCpu()
        c0 = service.cpu()
        req = self.parse(body, RankRequest)
        cpu.parse_s = service.cpu() - c0
        if deadline is not None and service.scheduler.clock() >= deadline:
            raise DeadlineExceeded("deadline passed on arrival; dropped before compute")
        return self._answered(service, arrived, req, cpu, await service.rank(req, deadline, cpu))

    async def _prefill(self, service: RankerService, body: bytes) -> Reply:
        arrived = service.scheduler.clock()
        if not service.ready:
            raise RequestError(503, "ranker is starting")
        cpu = RequestCpu()
        c0 = service.cpu()
        req = self.parse(body, PrefillRequest)
        cpu.parse_s = service.cpu() - c0
        return self._answered(service, arrived, req, cpu, await service.prefill(req, cpu))

    @staticmethod
    def _answered(service: RankerService, arrived: float, req: PrefillRequest | RankRequest, cpu: RequestCpu,
                  model: BaseModel) -> Reply:
        """The answer as the HTTP app gives it, its CPU logged and its time in the ranker in the header."""
        c0 = service.cpu()
        reply = _model(model)
        cpu.reply_s += service.cpu() - c0
        return Reply(reply.status, reply.body, {**reply.headers, RANKER_MS_HEADER: service.log_request(arrived, req, cpu)})
