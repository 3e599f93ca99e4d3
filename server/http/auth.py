"""API-key check on /v1/*: ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (Anthropic's header, sent by
the ``anthropic`` SDK and Claude Code) must name one of the configured keys; either header may carry it.

Paths under /v1 are guarded (as vLLM does), and so are /tokenize and /detokenize (they spend CPU on
whatever text a caller sends); /health, /metrics and /version stay open for load balancers and
Prometheus, as does the OpenAPI document. With no key configured every
path is open. Keys are compared in constant time; the scheme name is case-insensitive. The 401 is in
OpenAI's error shape, or Anthropic's on /v1/messages*.

The key a request presented is left in its ASGI scope (``authenticated_key(scope)``), so that
``--cache-isolation per-key`` can make each key its own cache tenant (state.py).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from flashtier.server.http.errors import error_body_for_path

PROTECTED_PREFIX = "/v1"
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})  # outside /v1, but they take a body of text to process
SCOPE_KEY = "flashtier.api_key"  # where the middleware leaves the key a request was let in with


def is_protected(path: str) -> bool:
    """Whether `path` needs a key (when keys are configured): /v1 and below, /tokenize, /detokenize."""
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_PATHS


def authenticated_key(scope: Scope) -> str | None:
    """The configured API key this request was let in with; None when no key is configured (or the path
    is not guarded)."""
    return scope.get(SCOPE_KEY)


class APIKeyMiddleware:
    """Pure ASGI middleware (it never wraps the body stream, so disconnect detection is unaffected)."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        self._keys = tuple(dict.fromkeys(api_keys))
        self._encoded = tuple(k.encode("utf-8") for k in self._keys)

    def _authorized(self, scope: Scope) -> str | None:
        """The configured key the request's bearer token or x-api-key equals, else None."""
        for name, value in scope.get("headers", ()):
            supplied: bytes | None = None
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").strip().partition(" ")
                if scheme.lower() == "bearer":
                    supplied = token.strip().encode("latin-1")
            elif name == b"x-api-key":
                supplied = value.strip()
            if supplied is None:
                continue
            # check every key, so timing does not tell which one nearly matched
            matches = [hmac.compare_digest(supplied, key) for key in self._encoded]
            key = next((k for k, ok in zip(self._keys, matches, strict=True) if ok), None)
            if key is not None:
                return key
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._keys or not is_protected(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        key = self._authorized(scope)
        if key is not None:
            scope[SCOPE_KEY] = key
            await self.app(scope, receive, send)
            return
        has_header = any(name in (b"authorization", b"x-api-key") for name, _ in scope.get("headers", ()))
        message = ("Incorrect API key provided" if has_header
                   else "Missing API key: send it as the header `Authorization: Bearer KEY` or `x-api-key: KEY`")
        body = json.dumps(error_body_for_path(scope.get("path", ""), 401, message, code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
