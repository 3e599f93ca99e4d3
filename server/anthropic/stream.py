"""The streamed form of a Messages answer: SSE events with ``event:`` names, in Anthropic's order::

    message_start (content [], usage so far) -> ping
    (content_block_start -> content_block_delta* -> content_block_stop)*     indexes 0, 1, 2, ...
    message_delta {stop_reason, stop_sequence} + usage -> message_stop

``message_start`` waits for the engine's first output, so its usage already splits the prompt into
cache reads and new input; ``message_delta`` repeats the final totals. There is no ``[DONE]``. An
error after the response started is an ``event: error`` with Anthropic's error body, and so is a
generation the engine ended without finishing it (there is no stop reason for that).
``stream_messages`` is generation.py's ``stream_response`` with this framing: the same loop, and the
same guarantee that every exit (a client disconnect included) closes the engine streams.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from flashtier.server.openai.chat_choice import ChatChoiceState
from flashtier.server.text.choice_text import TextStep
from flashtier.server.http.errors import APIError
from flashtier.server.serving.generation import Generation
from flashtier.server.http.anthropic_errors import anthropic_error_body
from flashtier.server.anthropic.output import ContentBlocks, WireEvent, messages_usage, stop_info
from flashtier.server.http.sse import SSEResponse

__all__ = ["MessagesStreamRenderer", "sse_named", "stream_messages"]

logger = logging.getLogger(__name__)

ABORTED = "the generation ended before it finished (the engine stopped); retry"


def sse_named(event: WireEvent) -> bytes:
    return (f"event: {event.name}\ndata: " + json.dumps(event.data, ensure_ascii=False) + "\n\n").encode("utf-8")


def _error_event(status: int, message: str) -> bytes:
    return sse_named(WireEvent("error", anthropic_error_body(status, message)))


@dataclass
class MessagesStreamRenderer:
    """Renders the one choice of a Messages generation as stream events; ``step``/``abort``/``tail`` mutate
    its blocks and the started flag."""

    gen: Generation[ChatChoiceState]
    blocks: ContentBlocks = field(default_factory=ContentBlocks)
    started: bool = False
    aborted: bool = False

    def step(self, choice: ChatChoiceState, step: TextStep) -> Iterable[bytes]:
        events = self._start() + self.blocks.feed(choice.step(step))
        if choice.text.finished:
            events += self._finish(choice)
        return [sse_named(e) for e in events]

    def abort(self, choice: ChatChoiceState) -> Iterable[bytes]:
        self.aborted = True
        events = self._start() + self.blocks.feed(choice.abort()) + self.blocks.close()
        return [sse_named(e) for e in events]

    def tail(self) -> Iterable[bytes]:
        """After the loop: the error event of an aborted generation (everything else was sent by step)."""
        return [_error_event(503, ABORTED)] if self.aborted else []

    def _start(self) -> list[WireEvent]:
        if self.started:
            return []
        self.started = True
        gen = self.gen
        message: dict[str, Any] = {"id": gen.request_id, "type": "message", "role": "assistant", "model": gen.model,
                                   "content": [], "stop_reason": None, "stop_sequence": None,
                                   "usage": messages_usage(gen.usage())}
        return [WireEvent("message_start", {"type": "message_start", "message": message}),
                WireEvent("ping", {"type": "ping"})]

    def _finish(self, choice: ChatChoiceState) -> list[WireEvent]:
        stop = stop_info(choice)
        if stop.reason is None:  # the engine ended it with "abort": tail() says so as an error event
            self.aborted = True
            return self.blocks.close()
        delta = {"stop_reason": stop.reason, "stop_sequence": stop.sequence}
        return [*self.blocks.close(),
                WireEvent("message_delta", {"type": "message_delta", "delta": delta,
                                            "usage": messages_usage(self.gen.usage())}),
                WireEvent("message_stop", {"type": "message_stop"})]


async def stream_messages(gen: Generation[ChatChoiceState], renderer: MessagesStreamRenderer) -> Response:
    """Start the engine request (admission errors are still plain HTTP errors), then stream its events.

    The engine streams are closed on every exit; a disconnect cancels the producer (SSEResponse), whose
    ``finally`` aborts the engine request.
    """
    await gen.start()

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in gen.render(renderer):
                yield chunk
            for chunk in renderer.tail():
                yield chunk
        except APIError as exc:
            yield _error_event(exc.status, exc.message)
        except Exception:
            logger.exception("stream %s failed", gen.request_id)
            yield _error_event(500, "internal server error; the details are in the server log")
        finally:
            await gen.close(renderer)

    return SSEResponse(events(), headers={"X-Request-Id": gen.request_id})
