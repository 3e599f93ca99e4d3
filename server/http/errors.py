"""Errors in OpenAI's shape, and the handlers that make sure nothing else reaches a client.

Every error response body is ``{"error": {"message", "type", "param", "code"}}``::

    400 invalid_request_error   malformed JSON, wrong types, out-of-range values, context overflow,
                                unknown tool in tool_choice, invalid UTF-8
    401 authentication_error    missing or wrong API key on /v1/*
    404 not_found_error         unknown model or route
    405 invalid_request_error   wrong method on a known route
    413 invalid_request_error   body over --max-request-bytes
    429 rate_limit_error        the engine's waiting queue is full (``QueueFullError``)
    500 server_error            anything unexpected: a generic message; the traceback goes to the log only
    503 server_error            the engine is not ready (loading) or has stopped (code not_ready), or the
                                server is shutting down (code shutting_down: SIGTERM's drain, serving/drain.py)

Route code raises ``APIError`` (or a subclass); ``install_error_handlers`` maps it, FastAPI's
validation errors, Starlette's HTTP errors and any other exception to that body. On the Messages API's
paths (/v1/messages*) the same statuses carry Anthropic's body instead (anthropic/errors.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashtier.engine.client import QueueFullError
from flashtier.server.http.error_types import OPENAI_TYPES
from flashtier.server.http.anthropic_errors import anthropic_error_body, is_messages_path

logger = logging.getLogger(__name__)

__all__ = [
    "APIError",
    "BadRequest",
    "NotFound",
    "ServiceUnavailable",
    "ShuttingDown",
    "error_body",
    "error_body_for_path",
    "error_response",
    "install_error_handlers",
]

_TYPES = OPENAI_TYPES


class APIError(Exception):
    """An error to return to the client as it is: status, message, and OpenAI's param/code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class BadRequest(APIError):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(400, message, param=param, code=code)


class NotFound(APIError):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(404, message, param=param, code=code)


class ServiceUnavailable(APIError):
    def __init__(self, message: str = "the engine is not ready; retry later") -> None:
        super().__init__(503, message, code="not_ready")


class ShuttingDown(APIError):
    """503 ``shutting_down``: a new request while the server drains, or one still running when the drain
    timeout passed (serving/drain.py). Answered with Retry-After, like every 503."""

    def __init__(self, message: str = "the server is shutting down; retry on another replica or later") -> None:
        super().__init__(503, message, code="shutting_down")


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_body_for_path(path: str, status: int, message: str, *, type: str | None = None,
                        param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """``error_body``, or Anthropic's shape (type by status; no param/code) on the Messages API's paths."""
    if is_messages_path(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, type=type, param=param, code=code)


def error_response(status: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None,
                   path: str = "") -> JSONResponse:
    body = error_body_for_path(path, status, message, type=type, param=param, code=code)
    return JSONResponse(body, status_code=status, headers=headers)


def api_error_response(exc: APIError, path: str = "") -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code, headers=headers,
                          path=path)


def queue_full_error(exc: QueueFullError | None = None) -> APIError:
    detail = f": {exc}" if exc is not None and str(exc) else ""
    return APIError(429, f"the server is at capacity (request queue full){detail}; retry later",
                    code="queue_full")


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"; None for the body as a whole."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part and not part.startswith(("function-after", "function-")):
            out += ("." if out else "") + part
    return out or None


def validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence (and the param) from pydantic's error list."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON{': ' + str(detail) if detail else ''}", None
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return "the request body is empty; send a JSON object", None
    param = _loc_to_param(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    # pydantic's "Value error, ..." prefix comes from validators raising ValueError.
    msg = msg.removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc, request.url.path)

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        return api_error_response(queue_full_error(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(400, message, param=param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = f"no route {request.method} {request.url.path}"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif status == 400:
            message = "the request body could not be parsed as JSON"
        else:
            message = str(exc.detail) if isinstance(exc.detail, str) else "request failed"
        if status >= 500:  # never echo internals
            message = "internal server error"
        return error_response(status, message, headers=getattr(exc, "headers", None), path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "internal server error; the details are in the server log",
                              path=request.url.path)
