"""Errors in Anthropic's shape, for the paths of the Messages API (/v1/messages and below).

Anthropic clients (the ``anthropic`` SDK, Claude Code) read ``{"type": "error", "error": {"type",
"message"}}`` and pick their exception class by HTTP status, so the status stays what the rest of the
server answers and only the body changes::

    400 invalid_request_error   401 authentication_error   403 permission_error   404 not_found_error
    405 invalid_request_error   413 request_too_large      429 rate_limit_error   500 api_error
    503 overloaded_error (Anthropic itself says 529; 503 keeps Retry-After semantics for proxies)

errors.py (exception handlers), auth.py (401) and app.py (413, invalid UTF-8) ask ``is_messages_path``
and build the body with ``anthropic_error_body``; a stream that already started sends the same body
as an ``event: error`` (anthropic/stream.py). This module imports nothing of the server, so all of them
can use it.
"""

from __future__ import annotations

from typing import Any

from flashtier.server.http.error_types import ANTHROPIC_TYPES

__all__ = ["ANTHROPIC_ERROR_SCHEMA", "MESSAGES_PREFIX", "anthropic_error_body", "anthropic_error_type",
           "is_messages_path"]

MESSAGES_PREFIX = "/v1/messages"

_TYPES = ANTHROPIC_TYPES


# the shape in /openapi.json (the schemathesis suite checks every error of these paths against it)
ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {
    "title": "AnthropicErrorResponse", "type": "object", "required": ["type", "error"], "additionalProperties": False,
    "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {"type": "object", "required": ["type", "message"], "additionalProperties": False,
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}


def is_messages_path(path: str) -> bool:
    """True for /v1/messages and every path below it (count_tokens, unknown sub-paths)."""
    return path == MESSAGES_PREFIX or path.startswith(MESSAGES_PREFIX + "/")


def anthropic_error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for an HTTP status; pure."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
