"""The ``error.type`` each API names for an HTTP status: OpenAI's, and Anthropic's (the same names for the
client errors both share, its own for a body too large, a server error and an overload)."""

from __future__ import annotations

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

ANTHROPIC_TYPES = {
    **OPENAI_TYPES,
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
