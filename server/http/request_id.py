"""X-Request-Id: a client's id for its request is echoed on the answer and logged beside the server's id.

vLLM answers with the request's id in an ``X-Request-Id`` header and takes the client's when one is sent.
Here every chat/completions answer carries the server's id (generation.py sets it); when the client sent
``X-Request-Id`` (1 to 128 visible ASCII characters, else it is ignored), ``RequestIdMiddleware`` puts
the client's value in that header instead, on every route and status (a 400 can be matched to its
request too), and logs the pair once (INFO, ``request <server id>: X-Request-Id <client id>``), so a
client's id finds the server's log lines. The server's own ids stay unique: two clients may send the
same value, and the engine needs distinct request ids.
"""

from __future__ import annotations

import logging
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["HEADER", "RequestIdMiddleware", "client_request_id"]

logger = logging.getLogger(__name__)

HEADER = b"x-request-id"
_VALID = re.compile(rb"[\x21-\x7e]{1,128}")


def client_request_id(scope: Scope) -> str | None:
    """The request's valid ``X-Request-Id`` header, or None."""
    for name, value in scope.get("headers", ()):
        if name == HEADER:
            return value.decode("ascii") if _VALID.fullmatch(value) else None
    return None


class RequestIdMiddleware:
    """Pure ASGI middleware: rewrites ``x-request-id`` of the response start when the client sent one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_id = client_request_id(scope) if scope["type"] == "http" else None
        if client_id is None:
            await self.app(scope, receive, send)
            return
        raw = client_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                server_id = next((v.decode("latin-1") for k, v in headers if k.lower() == HEADER), None)
                if server_id is not None and server_id != client_id:
                    logger.info("request %s: X-Request-Id %s", server_id, client_id)
                headers = [(k, v) for k, v in headers if k.lower() != HEADER]
                headers.append((HEADER, raw))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
