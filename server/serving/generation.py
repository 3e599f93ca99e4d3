"""The output loop that chat and completions share, and its two endings: an SSE stream or one JSON body.

    EngineStream(s) ──merge_outputs──▶ Generation.render ──(choice, TextStep)──▶ renderer ──▶ SSE chunks
     (one per prompt)                   (ChoiceText per choice;                   (a route's)     or one JSON body
                                         RequestTracker: usage, metrics)

A route builds a ``Generation``: its engine streams, and one state object per choice holding that
choice's ``ChoiceText``. The loop feeds every token delta through the choice's ``ChoiceText`` and hands
the resulting ``TextStep`` to the route's renderer; a choice the engine ended without finishing is
handed to ``renderer.abort``. ``stream_response`` renders SSE chunks as they come (the engine streams
are started first, so admission errors are still plain HTTP errors; later ones become an SSE error
event); ``json_response`` runs the same loop and answers with the renderer's body. Every exit path
closes the engine streams (aborting unfinished requests) and records the request's metrics once.

A started generation is in the server's ``Drain`` (drain.py) until it closes: past SIGTERM's drain timeout
``interrupt`` ends it with ``ShuttingDown``, which reaches the client as any ``APIError`` after the start
does (a JSON 503; in a stream, the API's error event and the stream's end).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from flashtier.server.text.choice_text import ChoiceText, TextStep
from flashtier.server.http.disconnect import ClientDisconnected, cancel_on_disconnect
from flashtier.server.serving.drain import Drain
from flashtier.server.serving.engine_stream import EngineStream, merge_outputs
from flashtier.server.http.errors import APIError
from flashtier.server.serving.metrics import RequestTracker
from flashtier.server.http.sse import SSE_DONE, SSEResponse, sse_error, sse_event
from flashtier.server.serving.state import merge_resume, sum_cache, usage_dict

__all__ = [
    "BodyRenderer", "Generation", "OutputChoice", "StreamRenderer", "json_response", "stream_events", "stream_response",
]

logger = logging.getLogger(__name__)


class OutputChoice(Protocol):
    """What the loop needs of a route's per-choice state."""

    index: int
    text: ChoiceText
    reasoning_tokens: int


C = TypeVar("C", bound=OutputChoice)
C_contra = TypeVar("C_contra", bound=OutputChoice, contravariant=True)


class ChoiceRenderer(Protocol[C_contra]):
    def step(self, choice: C_contra, step: TextStep) -> Iterable[bytes]:
        """Take what one delta added to an unfinished choice; return the SSE chunks it makes (if any)."""
        ...

    def abort(self, choice: C_contra) -> Iterable[bytes]:
        """The request ended without `choice` finishing: end it, return the chunks that says (if any)."""
        ...


class StreamRenderer(ChoiceRenderer[C_contra], Protocol[C_contra]):
    def head(self) -> Iterable[bytes]:
        """Chunks sent before any output (the assistant role, the echoed prompt)."""
        ...


class BodyRenderer(ChoiceRenderer[C_contra], Protocol[C_contra]):
    def body(self) -> dict[str, Any]:
        """The JSON answer, once every choice has ended."""
        ...


@dataclass
class Generation(Generic[C]):
    """One API request's engine streams and choices; choice ``k`` of stream ``i`` is ``choices[i * n + k]``."""

    request_id: str
    model: str
    chunk_object: str  # the `object` of a streamed chunk
    streams: list[EngineStream]
    choices: list[C]
    tracker: RequestTracker
    drain: Drain  # the server's in-flight generations (ServerState.drain): start() adds this one, close() removes it
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        """Choices per engine stream (the request's `n`)."""
        return len(self.choices) // len(self.streams)

    def usage(self) -> dict[str, Any]:
        """The request's ``usage``, from what the tracker recorded of every engine output."""
        prompt = sum(self.tracker.prompt_tokens(s.request_id) or len(s.prompt_token_ids) for s in self.streams)
        return usage_dict(prompt, sum(c.text.num_tokens for c in self.choices),
                          sum(c.reasoning_tokens for c in self.choices), sum_cache(self.tracker.caches),
                          merge_resume(self.tracker.resumes))

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              with_usage_field: bool = False) -> bytes:
        payload: dict[str, Any] = {"id": self.request_id, "object": self.chunk_object, "created": self.created,
                                   "model": self.model, "choices": choices}
        if with_usage_field:
            payload["usage"] = usage
        return sse_event(json.dumps(payload, ensure_ascii=False))

    async def render(self, renderer: ChoiceRenderer[C]) -> AsyncIterator[bytes]:
        """The output loop: every delta of every unfinished choice through its ChoiceText to `renderer`."""
        async for tagged in merge_outputs(self.streams):
            self.tracker.on_output(tagged.output)
            for delta in tagged.output.choices:
                choice = self.choices[tagged.index * self.n + delta.index]
                if choice.text.finished:
                    continue
                for chunk in renderer.step(choice, choice.text.add(delta)):
                    yield chunk
            if all(c.text.finished for c in self.choices):
                break
        for choice in self.choices:  # the engine ended a request without finishing this choice
            if not choice.text.finished:
                for chunk in renderer.abort(choice):
                    yield chunk

    async def start(self) -> None:
        """Enter the drain (``ShuttingDown`` once its timeout passed) and submit every engine request now
        (admission errors raise here); closes them all and leaves the drain on failure."""
        self.drain.add(self)
        try:
            for s in self.streams:
                await s.start()
        except BaseException:
            for s in self.streams:
                await s.close()
            self.drain.discard(self)
            raise

    def interrupt(self, reason: APIError) -> None:
        """End the generation with `reason` (the drain timeout): every engine stream's iteration raises it at
        its next await on the engine, so the output loop ends as with any error after the start."""
        for s in self.streams:
            s.interrupt(reason)

    async def close(self, renderer: ChoiceRenderer[C]) -> None:
        """Close the engine streams (aborting unfinished requests), leave the drain and record the metrics.
        Idempotent."""
        try:
            for s in self.streams:
                await s.close()
        finally:
            self.drain.discard(self)
        for choice in self.choices:
            if not choice.text.finished:
                renderer.abort(choice)
        self.tracker.finish(completion_tokens=sum(c.text.num_tokens for c in self.choices),
                            finish_reasons=[c.text.finish_reason for c in self.choices],
                            max_tokens=self.streams[0].params.max_tokens, n=self.n)


async def stream_events(gen: Generation[C], renderer: StreamRenderer[C], *,
                        finish: Callable[[], Awaitable[Iterable[bytes]]],
                        failed: Callable[[APIError], Iterable[bytes]],
                        log: logging.Logger = logger, what: str = "stream") -> Response:
    """Start the engine requests, then stream: the renderer's head and chunks, then ``await finish()``'s
    chunks. An error after the start ends the stream with ``failed(error)``'s chunks (any other exception
    as a logged 500, ``"<what> <request id> failed"`` on `log`); every exit closes the generation."""
    await gen.start()

    async def events() -> AsyncIterator[bytes]:
        try:
            for chunk in renderer.head():
                yield chunk
            async for chunk in gen.render(renderer):
                yield chunk
            for chunk in await finish():
                yield chunk
        except APIError as exc:
            for chunk in failed(exc):
                yield chunk
        except Exception:
            log.exception("%s %s failed", what, gen.request_id)
            for chunk in failed(APIError(500, "internal server error; the details are in the server log")):
                yield chunk
        finally:
            await gen.close(renderer)

    return SSEResponse(events(), headers={"X-Request-Id": gen.request_id})


async def stream_response(gen: Generation[C], renderer: StreamRenderer[C], *, include_usage: bool) -> Response:
    """Start the engine requests, then stream the renderer's chunks, the usage chunk and ``[DONE]``."""

    async def finish() -> list[bytes]:
        return [gen.chunk([], gen.usage(), True), SSE_DONE] if include_usage else [SSE_DONE]

    return await stream_events(gen, renderer, finish=finish, failed=lambda exc: [sse_error(exc), SSE_DONE])


async def json_response(request: Request, gen: Generation[C], renderer: BodyRenderer[C]) -> Response:
    """Run the loop to the end (cancelled if the client goes: 499), then answer the renderer's body."""

    async def complete() -> dict[str, Any]:
        try:
            gen.drain.add(gen)  # the engine requests start inside the loop (no admission grace: nothing is sent yet)
            async for _ in gen.render(renderer):
                pass
        finally:
            await gen.close(renderer)
        return renderer.body()

    try:
        result = await cancel_on_disconnect(request, complete())
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(result, headers={"X-Request-Id": gen.request_id})
