"""The FastAPI app: ``create_app(settings, engine_client_factory)``.

    client ─▶ HTTPMetrics ─▶ APIKey (/v1/*) ─▶ RequestBody (413, UTF-8) ─▶ FastAPI routes ─▶ EngineClient

The lifespan builds the engine client with the factory (a plain or async callable taking the
settings; the CLI passes one that builds the ``AsyncEngine``, tests a test double), and at shutdown
calls ``engine_client.shutdown(drain_timeout)``. uvicorn's graceful shutdown runs first: on SIGTERM
it stops accepting connections and waits (up to the same timeout) for in-flight responses, which
the engine keeps serving, before the lifespan stops the engine.

The served OpenAPI document (/openapi.json) lists the error responses each route really returns
(400 rather than FastAPI's 422) in OpenAI's error shape.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashtier import __version__
from flashtier.engine.client import EngineClient
from flashtier.server import routes_chat, routes_completions, routes_messages, routes_misc, routes_responses
from flashtier.server.auth import APIKeyMiddleware, is_protected
from flashtier.server.errors import error_body_for_path, install_error_handlers
from flashtier.server.metrics import ServerMetrics
from flashtier.server.response_store import open_response_store
from flashtier.server.settings import DEMO_NOTE, ServerSettings
from flashtier.server.state import ServerState
from flashtier.server.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

EngineClientFactory = Callable[[ServerSettings], EngineClient | Awaitable[EngineClient]]
_BODY_METHODS = ("POST", "PUT", "PATCH")


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    import json

    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": raw})


class RequestBodyMiddleware:
    """Reads a request body up front: 413 above the limit, 400 if it is not UTF-8.

    The body is then replayed to the app, and afterwards ``receive`` is the server's again, so
    routes still see ``http.disconnect``. Every body is JSON here: a missing or non-JSON content
    type (``curl -d`` sends form encoding) is treated as application/json.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        too_large = error_body_for_path(scope["path"], 413, f"the request body exceeds {self.max_bytes} bytes",
                                        code="request_too_large")
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await _send_json(send, 413, too_large)
                    return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await _send_json(send, 413, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await _send_json(send, 400, error_body_for_path(
                scope["path"], 400, f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8"))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        scope["headers"] = [*headers, (b"content-type", b"application/json")]  # in place: outer layers read it
        await self.app(scope, replay, send)


class HTTPMetricsMiddleware:
    """Counts responses by method, route template and status (``flashtier_http_requests_total``)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "other"
            self.metrics.http.labels(scope["method"], template, str(status)).inc()


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _openapi(app: FastAPI, settings: ServerSettings) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title="flashtier", version=__version__, routes=app.routes,
                         description="OpenAI-compatible server for DeepSeek-V4.1-Flash. Errors are "
                                     '`{"error": {"message", "type", "param", "code"}}`.')
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    generating = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if method == "post":
                responses["400"] = _error_response("Invalid request (malformed JSON, wrong type or value)")
                responses["413"] = _error_response("Request body too large")
            if "{" in path or path in generating or method == "post":
                responses["404"] = _error_response("Unknown model")
            if is_protected(path) and settings.api_key:
                responses["401"] = _error_response("Missing or wrong API key")
            if path in generating or path == "/health":
                responses["503"] = _error_response("Engine not ready")
            if path in generating:
                responses["429"] = _error_response("Request queue full; retry later")
                # one SSE event per item: its data field carries a JSON chunk (or [DONE])
                sse_event = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": sse_event}
            responses["500"] = _error_response("Internal error (no details are returned)")
    app.openapi_schema = schema
    return schema


def create_app(settings: ServerSettings, engine_client_factory: EngineClientFactory, *,
               tokenizer: Tokenizer | None = None) -> FastAPI:
    """The ASGI app. `tokenizer` defaults to --tokenizer, else the model directory's, else the shipped one."""
    if tokenizer is None:
        tokenizer = (Tokenizer(settings.tokenizer) if settings.tokenizer
                     else Tokenizer.from_model_dir(settings.model_dir))
    holder: dict[str, ServerState] = {}

    def engine_stats() -> Any:
        engine = holder["state"].engine if holder else None
        return engine.stats() if engine is not None else None

    def engine_ready() -> bool:
        engine = holder["state"].engine if holder else None
        return engine is not None and engine.is_ready()

    metrics = ServerMetrics(settings.model_name, max_model_len=settings.max_model_len or (1 << 20),
                            stats=engine_stats, ready=engine_ready, version=__version__, demo=settings.is_demo)
    state = holder["state"] = ServerState(settings, tokenizer, metrics)
    responses = state.response_store = open_response_store(settings)  # no disk or network until used

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.is_demo:
            logger.warning("%s", DEMO_NOTE)
        built = engine_client_factory(settings)
        engine: EngineClient = await built if inspect.isawaitable(built) else built
        state.engine = engine
        logger.info("serving %s (max_model_len %s)", list(settings.model_names), engine.max_model_len)
        try:
            yield
        finally:
            logger.info("stopping the engine (drain timeout %.1f s)", settings.drain_timeout_s)
            await engine.shutdown(settings.drain_timeout_s)
            await responses.close()

    app = FastAPI(title="flashtier", version=__version__, lifespan=lifespan, openapi_url="/openapi.json",
                  docs_url="/docs", redoc_url=None)
    app.state.flashtier = state
    install_error_handlers(app)
    app.include_router(routes_chat.router)
    app.include_router(routes_completions.router)
    app.include_router(routes_misc.router)
    app.include_router(routes_messages.router)
    app.include_router(routes_responses.router)
    # added last = outermost
    app.add_middleware(RequestBodyMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(APIKeyMiddleware, api_keys=settings.api_key)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    app.openapi = lambda: _openapi(app, settings)  # type: ignore[method-assign]
    return app
