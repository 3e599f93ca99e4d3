"""Server-sent events: the ``data: ...`` framing and ``SSEResponse``, which streams them while
watching the connection; a disconnect cancels the producer, whose ``finally`` aborts the engine request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from flashtier.server.http.disconnect import wait_for_disconnect
from flashtier.server.http.errors import APIError, error_body

__all__ = ["SSE_DONE", "SSEResponse", "sse_error", "sse_event"]

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: str) -> bytes:
    return b"data: " + payload.encode("utf-8") + b"\n\n"


def sse_error(error: APIError) -> bytes:
    body = error_body(error.status, error.message, type=error.type, param=error.param, code=error.code)
    return sse_event(json.dumps(body, ensure_ascii=False))


class SSEResponse(Response):
    """``text/event-stream`` from an async iterator of encoded events; a disconnect cancels the producer.

    Starlette's StreamingResponse only notices a disconnect when a write fails (ASGI spec >= 2.4)
    or cancels through an anyio scope in which cleanup cannot await; here the producer runs as a
    plain task, so its ``finally`` (which aborts the engine request) always runs to completion.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (producer, watcher):
                t.cancel()
            results = await asyncio.gather(producer, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
            logger.error("SSE producer failed", exc_info=results[0])

    async def _produce(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
