"""What the ranker and router HTTP servers share (aiohttp): JSON errors, body parsing, OpenAPI, metrics.

Every error is JSON ``{"error": "...", "status": N}``: malformed JSON is 400, a body over the limit 413,
a well-formed body that fails validation 422 naming each bad field. Unexpected failures are 500 and are
logged; the server keeps serving in every case.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError

from grstack.runtime.serve.schemas import ErrorResponse
from grstack.runtime.serve.security import GuardedSite, ServerSecurity

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY = web.AppKey("max_body_bytes", int)
# milliseconds left of a rank's budget: set by a client or the router, honoured by router and ranker
DEADLINE_HEADER = "X-Grstack-Deadline-Ms"
# Where a rank's time went, on its way back (each process's own clock; only differences are read): the ranker's
# handler, the router's answering attempt's round trip to it, and the router's handler.
RANKER_MS_HEADER = "X-Grstack-Ranker-Ms"
FORWARD_MS_HEADER = "X-Grstack-Forward-Ms"
ROUTER_MS_HEADER = "X-Grstack-Router-Ms"


class RequestError(Exception):
    """A client mistake found after schema validation (e.g. an item id beyond the catalogue)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_DEADLINE_RE = re.compile(r"[0-9]{1,15}(\.[0-9]{0,9})?")


def parse_deadline_ms(raw: str | None) -> float | None:
    """The ``X-Grstack-Deadline-Ms`` value: a plain non-negative decimal number of milliseconds. Anything
    else (nan, inf, a sign, an exponent, text) is a 400 naming the header: none of them means "no deadline"."""
    if raw is None:
        return None
    value = raw.strip()
    if not _DEADLINE_RE.fullmatch(value):
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise RequestError(400, f"{DEADLINE_HEADER}: expected a non-negative number of milliseconds, got {shown!r}")
    return float(value)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, content_type="application/json", headers=headers,
                        text=ErrorResponse(error=message, status=status).model_dump_json())


def route_template(request: web.Request) -> str:
    """The matched route's template (``/v1/rank``), never the raw path: a metric label of bounded
    cardinality. Unmatched paths are ``unmatched``."""
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    if resource is None or getattr(info, "http_exception", None) is not None:
        return "unmatched"
    return resource.canonical


def status_class(status: int) -> str:
    return f"{status // 100}xx"


def model_response(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(status=status, body=model.model_dump_json().encode(), content_type="application/json")


def format_validation(exc: ValidationError, limit: int = 5) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{loc}: {msg}")
    more = len(exc.errors()) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


async def parse_body(request: web.Request, model: type[M]) -> M:
    return parse_json(await request.read(), model)  # read() raises 413 over client_max_size


def parse_json(body: bytes, model: type[M]) -> M:
    """A request body as ``model``, or the :class:`RequestError` (400/422) the client is answered."""
    if not body:
        raise RequestError(400, "empty request body; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise RequestError(400, f"malformed JSON: {exc.errors()[0]['msg']}") from None
        raise RequestError(422, format_validation(exc)) from None


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as exc:
        return error_response(exc.status, exc.message)
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"request body too large (limit {request.app[MAX_BODY]} bytes)")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal error (logged by the server)")


def metrics_handler(registry: CollectorRegistry) -> Handler:
    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle


def openapi_document(title: str, version: str, routes: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAPI 3.1 from pydantic models. ``routes``: method, path, summary, request (model), responses
    ({status: model or None})."""
    from pydantic.json_schema import models_json_schema

    models: list[type[BaseModel]] = [ErrorResponse]
    for r in routes:
        if r.get("request") is not None:
            models.append(r["request"])
        models += [m for m in r["responses"].values() if m is not None]
    unique = list(dict.fromkeys(models))
    _, top = models_json_schema([(m, "validation") for m in unique],
                                ref_template="#/components/schemas/{model}")
    schemas = top.get("$defs", {})
    ref = lambda m: {"$ref": f"#/components/schemas/{m.__name__}"}  # noqa: E731
    paths: dict[str, Any] = {}
    for r in routes:
        op: dict[str, Any] = {"summary": r["summary"], "responses": {}}
        if r.get("request") is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(r["request"])}}}
        for status, m in r["responses"].items():
            content = r.get("content_type", "application/json")
            body = {"content": {content: {"schema": ref(m)}}} if m is not None else {}
            op["responses"][str(status)] = {"description": r.get("describe", {}).get(status, "OK"), **body}
        if r.get("request") is not None:
            for status, text in ((400, "malformed JSON"), (413, "body too large"), (422, "invalid request")):
                op["responses"][str(status)] = {"description": text, "content": {
                    "application/json": {"schema": ref(ErrorResponse)}}}
        paths.setdefault(r["path"], {})[r["method"].lower()] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": schemas}}


def openapi_handler(doc: dict[str, Any]) -> Handler:
    text = json.dumps(doc)

    async def handle(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="application/json")

    return handle


async def start_site(app: web.Application, host: str, port: int,
                     security: ServerSecurity | None = None) -> tuple[web.AppRunner, str]:
    """Starts ``app`` on host:port (0 = a free port) and returns the runner and the base URL (https:// with TLS).

    Handlers are cancelled when their client goes away (e.g. a router timed out), so queued work for an
    abandoned request is dropped instead of computed. Connections get ``security``'s header and idle timeouts
    and connection cap (the defaults when None); its token and body checks are the app's :func:`guard`
    middleware, which the app factories install.
    """
    security = security or ServerSecurity()
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = GuardedSite(runner, host, port, security)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, f"{security.scheme}://{host}:{site.port}"
