"""The FastAPI app: ``create_app(settings, engine_client_factory)``.

    client ─▶ HTTPMetrics ─▶ RequestId ─▶ CORS ─▶ APIKey ─▶ RequestBody (413, UTF-8) ─▶ FastAPI routes
                                                                                            ─▶ EngineClient

RequestId echoes a client's X-Request-Id (request_id.py); CORS is Starlette's, only with
--allowed-origins; APIKey guards /v1/*, /tokenize and /detokenize (auth.py); /admin/v1/* checks its own
--admin-api-key (routes_admin.py); RequestBody applies
--max-tokenize-bytes to /tokenize and /detokenize and --max-request-bytes to every other route.
Large bodies are checked for UTF-8 on the frontend pool, parsed and validated there (pooled_route.py),
and once such a request is answered the pool hands the freed heap back to the system (frontend_pool.py).

The lifespan starts building the engine client with the factory (a plain or async callable taking the
settings; the CLI passes one that starts the engine core, tests a test double) and yields at once: the
port opens while the model loads, /metrics is served throughout and /health answers 503 naming the phase
(loading, warming up) until the engine is ready. A factory that raises is one ERROR line, ``the engine could
not be started: <cause>`` (the traceback at DEBUG), and ``on_fatal`` (the CLI exits with status 2).

Shutdown (serving/drain.py): SIGTERM or SIGINT starts ``ServerState.drain`` at once (the CLI's
``DrainingServer``): new generation requests get 503 ``shutting_down``, in-flight ones run until they finish
or --drain-timeout passes, and then end in their API's shape (a JSON 503, a stream's error event). uvicorn
meanwhile stops listening and waits for the connections; then the lifespan stops the engine
(``engine_client.shutdown(0)`` after a drain: nothing is left to wait for).

The served OpenAPI document (/openapi.json) lists the error responses each route really returns
(400 rather than FastAPI's 422) in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import gc
import importlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashtier import __version__
from flashtier.engine.client import EngineClient
from flashtier.server import routes_admin, routes_misc
from flashtier.server.anthropic import route as routes_messages
from flashtier.server.openai import chat_route as routes_chat, completions_route as routes_completions
from flashtier.server.responses import route as routes_responses
from flashtier.server.http.auth import APIKeyMiddleware, is_protected
from flashtier.server.http.errors import error_body_for_path, install_error_handlers
from flashtier.server.http.frontend_pool import FrontendPool
from flashtier.server.http.anthropic_errors import ANTHROPIC_ERROR_SCHEMA, is_messages_path
from flashtier.server.serving.metrics import ServerMetrics
from flashtier.server.http.request_id import RequestIdMiddleware
from flashtier.server.response_store.store import open_response_store
from flashtier.server.config.settings import ServerSettings
from flashtier.server.config.startup_log import log_startup
from flashtier.server.serving.state import ServerState
from flashtier.server.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

EngineClientFactory = Callable[[ServerSettings], EngineClient | Awaitable[EngineClient]]
_BODY_METHODS = ("POST", "PUT", "PATCH")
TOKENIZE_PATHS = ("/tokenize", "/detokenize")  # body limit: --max-tokenize-bytes
LARGE_BODY_BYTES = 1 << 20  # above: UTF-8 checked on the pool, heap trimmed after the answer


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

    def __init__(self, app: ASGIApp, max_bytes: int, *, path_limits: dict[str, int] | None = None,
                 pool: FrontendPool | None = None) -> None:
        """`path_limits`: a smaller limit for some paths; `pool`: where large bodies are checked, and
        whose ``release_memory`` runs after a request with one (None: inline, no trim)."""
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})
        self.pool = pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.max_bytes)
        too_large = error_body_for_path(scope["path"], 413, f"the request body exceeds {limit} bytes",
                                        code="request_too_large")
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await _send_json(send, 413, too_large)
                    return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                await _send_json(send, 413, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        pool = self.pool if len(body) > LARGE_BODY_BYTES else None
        try:
            if pool is not None:
                await pool.run(_check_utf8, body)
            else:
                _check_utf8(body)
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
        try:
            await self.app(scope, replay, send)
        finally:
            if pool is not None:
                body = b""  # the replay closure's reference; the route's are gone with its Request
                pool.release_memory()


def _check_utf8(body: bytes, step: int = 1 << 20) -> None:
    """UnicodeDecodeError (``start`` = the offset in `body`) unless `body` is UTF-8. Decoded `step` bytes at
    a time (a character split between steps is carried over), so no call holds the GIL long."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    for at in range(0, len(body), step):
        carried = len(decoder.getstate()[0])
        try:
            decoder.decode(body[at:at + step], final=at + step >= len(body))
        except UnicodeDecodeError as exc:
            exc.start += at - carried
            raise


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


def _error_response(description: str, shape: str = "ErrorResponse") -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}}


def _openapi(app: FastAPI, settings: ServerSettings) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title="flashtier", version=__version__, routes=app.routes,
                         description="OpenAI-compatible server for DeepSeek-V4.1-Flash. Errors are "
                                     '`{"error": {"message", "type", "param", "code"}}`.')
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["AnthropicErrorResponse"] = ANTHROPIC_ERROR_SCHEMA
    generating = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
    for path, ops in schema.get("paths", {}).items():
        shape = "AnthropicErrorResponse" if is_messages_path(path) else "ErrorResponse"
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
            for status, response in responses.items():
                if status[0] in "45":  # the Messages API answers errors in Anthropic's shape
                    response.update(_error_response(response["description"], shape))
    app.openapi_schema = schema
    return schema


async def _build(factory: EngineClientFactory, settings: ServerSettings,
                 set_phase: Callable[[str], None]) -> EngineClient:
    """Call the engine factory: an async one on the loop, a sync one on a daemon thread (a model load takes
    minutes; a daemon is not waited for at exit when the server stops meanwhile). A factory that takes a
    ``phase`` keyword gets ``set_phase`` (``_model_engine`` reports its warm-up)."""
    kwargs = {"phase": set_phase} if "phase" in inspect.signature(factory).parameters else {}
    if inspect.iscoroutinefunction(factory):
        return await factory(settings, **kwargs)
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def load() -> None:
        try:
            result = factory(settings, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop
            # bound now: Python unbinds `exc` when this block ends, which may be before the loop runs the callback
            loop.call_soon_threadsafe(lambda failure=exc: done.done() or done.set_exception(failure))
        else:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

    threading.Thread(target=load, name="engine-loader", daemon=True).start()
    built = await done
    return await built if inspect.isawaitable(built) else built


def create_app(settings: ServerSettings, engine_client_factory: EngineClientFactory, *,
               tokenizer: Tokenizer | None = None, on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """The ASGI app. `tokenizer` defaults to --tokenizer, else the model directory's, else the shipped one.
    ``on_fatal``: called on the event loop when the engine cannot be built (the CLI stops the server)."""
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
                            stats=engine_stats, ready=engine_ready, phase=lambda: holder["state"].phase if holder else "loading",
                            version=__version__, demo=settings.is_demo)
    state = holder["state"] = ServerState(settings, tokenizer, metrics)
    responses = state.response_store = open_response_store(settings)  # no disk or network until used

    def set_phase(phase: str) -> None:
        """The factory reports its phase (``"warming up"``) from the loader thread."""
        state.phase = phase
        logger.info("engine: %s", phase)

    async def start_engine() -> None:
        """Build the engine (a sync factory on a daemon loader thread: the port is open and /health, /metrics
        answer meanwhile), then serve. Mutates ``state.engine`` / ``phase`` / ``ready``. Failure: logged with
        its traceback, phase "failed" (/health 503 says so) and ``on_fatal`` asks the server to stop."""
        t0 = time.monotonic()
        try:
            engine = await _build(engine_client_factory, settings, set_phase)
        except Exception as exc:  # noqa: BLE001 - any load failure ends the server, with its cause in the log
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            logger.error("the engine could not be started: %s", cause)  # one line; the traceback is for DEBUG
            logger.debug("the engine's start-up failure", exc_info=True)
            state.phase = f"failed ({cause})"
            if on_fatal is not None:
                on_fatal()
            return
        if settings.engine_config().warmup:
            # the grammar engine, imported where first used (engine/grammar/compiler.py), loaded off the loop now
            # so that no structured-output request waits for it
            await asyncio.to_thread(importlib.import_module, "xgrammar")
        state.engine = engine
        logger.info("serving %s (max_model_len %s)", list(settings.model_names), engine.max_model_len)
        log_startup(settings, engine)  # device, pool, tiers, URL; the demo note as INFO
        # Start-up objects (torch, the model, pydantic schemas) never die: freeze them out of the cyclic GC, whose
        # full collections otherwise walk them all (~150 ms on the event loop, measured) while requests wait.
        gc.collect()
        gc.freeze()
        state.phase = "ready"
        state.ready.set()
        logger.info("ready in %.1f s", time.monotonic() - t0)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(start_engine(), name="engine-start")
        try:
            yield
        finally:
            state.phase = "stopping"
            state.drain.close()
            if not starting.done():  # stopped while loading: the loader thread is a daemon, left behind
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
            if state.engine is not None:
                # after a drain every request has ended (finished, or answered 503 at its timeout): nothing to
                # wait for; stopped without one (a test's uvicorn, an embedding app), the engine drains itself
                timeout = 0.0 if state.drain.draining else settings.drain_timeout_s
                logger.info("stopping the engine (timeout %.1f s)", timeout)
                await state.engine.shutdown(timeout)
            await responses.close()
            state.cpu_pool.shutdown()

    app = FastAPI(title="flashtier", version=__version__, lifespan=lifespan, openapi_url="/openapi.json",
                  docs_url="/docs", redoc_url=None)
    app.state.flashtier = state
    install_error_handlers(app)
    app.include_router(routes_chat.router)
    app.include_router(routes_completions.router)
    app.include_router(routes_misc.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_messages.router)
    app.include_router(routes_responses.router)
    # added last = outermost
    app.add_middleware(RequestBodyMiddleware, max_bytes=settings.max_request_bytes, pool=state.cpu_pool,
                       path_limits=dict.fromkeys(TOKENIZE_PATHS, settings.max_tokenize_bytes))
    app.add_middleware(APIKeyMiddleware, api_keys=settings.api_key)
    if settings.allowed_origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                           allow_credentials=settings.allow_credentials, expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    app.openapi = lambda: _openapi(app, settings)  # type: ignore[method-assign]
    return app
