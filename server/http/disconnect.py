"""Watching the connection of a request that is not streamed: ``cancel_on_disconnect`` cancels the
work when the client goes away (vLLM's ``with_cancellation`` pattern); ``SSEResponse`` (sse.py) does
the same for streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive

__all__ = ["ClientDisconnected", "cancel_on_disconnect", "wait_for_disconnect"]

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.

    The body must already have been read (FastAPI has, for a JSON body): what ``receive`` returns
    afterwards is only ``http.disconnect``.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done() or not watcher.done():
            for t in (task, watcher):
                t.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    watcher.cancel()
    return task.result()
