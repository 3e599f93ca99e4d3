"""Rendering a chat ``Generation`` as a Responses answer: SSE events, or one ``response`` object.

``ResponsesRenderer`` is both of generation.py's renderers for a one-choice generation: streaming, every
parser event becomes the events ``OutputBuilder`` makes (responses/output.py), framed as
``event: <type>\\ndata: <json>\\n\\n`` with an increasing ``sequence_number``; not streaming, the same
builder only folds them, so the body's output equals the streamed one.

``stream_responses`` is generation.stream_events (as stream_response is) with this framing (no ``data: [DONE]``)::

    response.created, response.in_progress, <item events>..., then, after `on_final(response)` ran
    (the route stores the response there), response.completed | response.incomplete | response.failed

An error after the stream started ends it with an ``error`` event and ``response.failed``. Admission
errors (queue full, engine not ready) are raised before the stream starts: plain HTTP errors. A client
that disconnects cancels the producer (sse.SSEResponse), whose ``finally`` aborts the engine request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from flashtier.server.openai.chat_choice import ChatChoiceState
from flashtier.server.text.choice_text import TextStep
from flashtier.server.http.errors import APIError
from flashtier.server.serving.generation import Generation, stream_events
from flashtier.server.responses.response_object import ResponseEnvelope, response_status, responses_usage
from flashtier.server.responses.output import OutputBuilder

__all__ = ["ResponsesRenderer", "stream_responses"]

logger = logging.getLogger(__name__)

_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


@dataclass
class ResponsesRenderer:
    """Stream events (``streaming``) or nothing per step; ``result()`` is the final response object."""

    gen: Generation[ChatChoiceState]
    envelope: ResponseEnvelope
    builder: OutputBuilder
    streaming: bool
    _seq: int = 0
    _final: dict[str, Any] | None = field(default=None, repr=False)

    def head(self) -> list[bytes]:
        snapshot = self.envelope.render("in_progress", [])
        return self._encode([{"type": "response.created", "response": snapshot},
                             {"type": "response.in_progress", "response": snapshot}])

    def step(self, choice: ChatChoiceState, step: TextStep) -> Iterable[bytes]:
        events = self.builder.add(choice.step(step))
        if choice.text.finished:
            events += self.builder.finish("incomplete" if choice.finish_reason == "length" else "completed")
        return self._encode(events)

    def abort(self, choice: ChatChoiceState) -> Iterable[bytes]:
        return self._encode(self.builder.add(choice.abort()) + self.builder.finish("incomplete"))

    def body(self) -> dict[str, Any]:
        return self.result()

    def result(self) -> dict[str, Any]:
        """The final response object (built once, after the output loop)."""
        if self._final is None:
            status, reason = response_status(self.gen.choices[0].finish_reason)
            error = ({"code": "server_error", "message": "the generation ended before it finished (aborted)"}
                     if status == "failed" else None)
            self._final = self.envelope.render(status, self.builder.items, responses_usage(self.gen.usage()),
                                               incomplete_reason=reason, error=error)
        return self._final

    def terminal(self) -> bytes:
        final = self.result()
        return self._event({"type": _TERMINAL[final["status"]], "response": final})

    def failed(self, exc: APIError) -> list[bytes]:
        """The events ending a stream that failed with `exc`."""
        code = "rate_limit_exceeded" if exc.status == 429 else "server_error"
        response = self.envelope.render("failed", self.builder.items, responses_usage(self.gen.usage()),
                                        error={"code": code, "message": exc.message})
        return [self._event({"type": "error", "code": exc.code or exc.type, "message": exc.message,
                             "param": exc.param}),
                self._event({"type": "response.failed", "response": response})]

    def _encode(self, events: list[dict[str, Any]]) -> list[bytes]:
        return [self._event(e) for e in events] if self.streaming else []

    def _event(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self._seq
        self._seq += 1
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {payload['type']}\ndata: {data}\n\n".encode()


async def stream_responses(gen: Generation[ChatChoiceState], renderer: ResponsesRenderer,
                           on_final: Callable[[dict[str, Any]], Awaitable[None]]) -> Response:
    """Start the engine request, then stream the events; `on_final(response)` runs before the terminal
    event (so a client that saw ``response.completed`` can already continue from it)."""

    async def finish() -> list[bytes]:
        await on_final(renderer.result())
        return [renderer.terminal()]

    return await stream_events(gen, renderer, finish=finish, failed=renderer.failed, log=logger,
                               what="response stream")
