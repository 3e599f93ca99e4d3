"""From engine outputs to what a client reads: the request lifecycle, text deltas, SSE framing.

    engine.generate ──RequestOutput──▶ EngineStream ──ChoiceDelta──▶ ChoiceText ──text──▶ route ──▶ SSE / JSON
       (token ids)                 (abort on close)            (detokenize, stop strings)

- ``EngineStream`` owns one engine request: it submits it, waits a moment for admission errors
  (so a full queue is a 429 even for ``stream=true``), and on close aborts it unless it finished.
  Closing happens on every exit path: client disconnect, stop string, error, normal end.
- ``ChoiceText`` turns one choice's token deltas into text: incremental detokenization and stop
  strings (found in the detokenized text, the text truncated before them; text that may be the
  start of a stop string is held back until the next delta decides it).
- ``SSEResponse`` streams ``data: ...`` events while watching the connection; a disconnect cancels
  the producer, whose ``finally`` aborts the engine request. ``cancel_on_disconnect`` does the same
  for non-streaming handlers (vLLM's ``with_cancellation`` pattern).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from flashtier.engine.client import EngineClient, QueueFullError
from flashtier.engine.outputs import ChoiceDelta, RequestOutput, TokenLogprob
from flashtier.engine.sampling_params import SamplingParams
from flashtier.server.errors import APIError, BadRequest, ServiceUnavailable, error_body, queue_full_error
from flashtier.server.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("flashtier.server")

T = TypeVar("T")

# How long a new request may take to show an admission error (queue full, too long) before the
# response starts; errors after it are sent as an SSE error event.
FIRST_OUTPUT_GRACE_S = 0.1
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: str) -> bytes:
    return b"data: " + payload.encode("utf-8") + b"\n\n"


def sse_error(error: APIError) -> bytes:
    import json

    body = error_body(error.status, error.message, type=error.type, param=error.param, code=error.code)
    return sse_event(json.dumps(body, ensure_ascii=False))


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


# ---- connection watching ------------------------------------------------------------------------------


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


# ---- one engine request -------------------------------------------------------------------------------


def engine_error(exc: BaseException, engine: EngineClient | None = None) -> APIError | None:
    """The client-facing error of an exception the engine raised, or None (a bug: 500).

    Anything else raised while the engine reports itself not ready (shutting down, dead) is a 503.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return queue_full_error(exc)
    if isinstance(exc, ValueError):
        return BadRequest(str(exc))
    if engine is not None and isinstance(exc, Exception):
        try:
            ready = engine.is_ready()
        except Exception:
            ready = False
        if not ready:
            return ServiceUnavailable("the engine stopped or is shutting down; retry later")
    return None


class EngineStream:
    """One engine request; iterate ``outputs()`` and always ``close()`` (aborts if unfinished).

    Errors the engine raises (``QueueFullError``, ``ValueError``) come out as ``APIError``.
    """

    def __init__(self, engine: EngineClient, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, cache_salt: str | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.cache_salt = cache_salt
        self.finished = False
        self.aborted = False
        self._gen: AsyncIterator[RequestOutput] | None = None
        self._first: asyncio.Future[RequestOutput] | None = None
        self._closed = False

    async def start(self, grace_s: float = FIRST_OUTPUT_GRACE_S) -> None:
        """Submit, and wait up to `grace_s` for the first output so that admission errors surface now."""
        self._gen = self.engine.generate(self.request_id, self.prompt_token_ids, self.params,
                                         cache_salt=self.cache_salt)
        self._first = asyncio.ensure_future(self._gen.__anext__())
        await asyncio.wait({self._first}, timeout=grace_s)
        if self._first.done() and not self._first.cancelled() and self._first.exception() is not None:
            exc = self._first.exception()
            self._first = None
            self.finished = True  # never admitted: nothing to abort
            if isinstance(exc, StopAsyncIteration):
                raise APIError(500, "the engine ended the request without output")
            raise engine_error(exc, self.engine) or exc  # type: ignore[misc]

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        if self._gen is None:
            await self.start(grace_s=0.0)
        assert self._gen is not None
        while not self.finished:
            try:
                if self._first is not None:
                    first, self._first = self._first, None
                    out = await first
                else:
                    out = await self._gen.__anext__()
            except StopAsyncIteration:
                self.finished = True
                return
            except Exception as exc:
                self.finished = True  # the engine dropped the request itself
                error = engine_error(exc, self.engine)
                if error is None:
                    raise
                raise error from exc
            if out.finished:
                self.finished = True
            yield out

    async def close(self) -> None:
        """Abort the engine request unless it finished, and release the generator. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._first is not None and not self._first.done():
            self._first.cancel()
            with contextlib.suppress(BaseException):
                await self._first
        if not self.finished and self._gen is not None:
            self.aborted = True
            try:
                await asyncio.shield(self.engine.abort(self.request_id))
            except Exception:
                logger.exception("abort of %s failed", self.request_id)
        if self._gen is not None:
            with contextlib.suppress(Exception):
                await self._gen.aclose()  # type: ignore[attr-defined]


async def merge_outputs(streams: Sequence[EngineStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0].outputs():
            yield 0, out
        return
    iters = [s.outputs() for s in streams]
    pending: dict[asyncio.Future[RequestOutput], int] = {
        asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iters)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iters[i].__anext__())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


# ---- text of one choice -------------------------------------------------------------------------------


def _held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class StopMatcher:
    """Finds the first stop string in a text arriving in pieces; holds back possible partial matches."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop
        self._held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string matched or None). After a match, stop pushing."""
        if not self._stops:
            return text, None
        buf = self._held + text
        hit: tuple[int, str] | None = None
        for stop in self._stops:
            at = buf.find(stop)
            if at >= 0 and (hit is None or at < hit[0]):
                hit = (at, stop)
        if hit is not None:
            at, stop = hit
            self._held = ""
            return buf[:at] + (stop if self._include else ""), stop
        keep = _held_suffix(buf, self._stops)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


@dataclass(slots=True)
class TextStep:
    """What one ChoiceDelta added to a choice."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # engine level: stop | length | abort
    stop_reason: int | str | None = None  # the stop string or stop token id (None for EOS)


class ChoiceText:
    """Detokenizes one choice and applies its stop strings; ``add`` once per ChoiceDelta."""

    def __init__(self, tokenizer: Tokenizer, *, stops: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = False, eos_token_id: int | None = None) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop = StopMatcher(stops, include_stop)
        self._eos = eos_token_id
        self.num_tokens = 0
        self.token_ids: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, delta: ChoiceDelta) -> TextStep:
        step = TextStep()
        if self.finished:
            return step
        lps = delta.logprobs or ()
        for k, tok in enumerate(delta.token_ids):
            piece = self._detok.add_token(tok)
            self.num_tokens += 1
            self.token_ids.append(tok)
            step.token_ids.append(tok)
            if k < len(lps):
                step.logprobs.append(lps[k])
            emit, hit = self._stop.push(piece)
            step.text += emit
            if hit is not None:
                self._finish(step, "stop", hit)
                return step
        if delta.finish_reason is not None:
            emit, hit = self._stop.push(self._detok.flush())
            step.text += emit
            if hit is not None:
                self._finish(step, "stop", hit)
                return step
            step.text += self._stop.flush()
            stop_id = delta.stop_token_id if delta.stop_token_id != self._eos else None
            self._finish(step, delta.finish_reason, stop_id)
        return step

    def abort(self) -> TextStep:
        """The request ended without this choice finishing (client gone, engine stopped)."""
        step = TextStep()
        if not self.finished:
            step.text = self._stop.push(self._detok.flush())[0] + self._stop.flush()
            self._finish(step, "abort", None)
        return step

    def _finish(self, step: TextStep, reason: str, stop_reason: int | str | None) -> None:
        self.finished = True
        self.finish_reason = step.finish_reason = reason
        self.stop_reason = step.stop_reason = stop_reason


# ---- token texts for logprobs -------------------------------------------------------------------------


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes stand for themselves, the other 68
    bytes for the code points from 256 upward, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


class TokenTexts:
    """Per-token text and exact UTF-8 bytes, for logprobs (cached)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._decoder = _byte_level_decoder()
        self._special = tokenizer.special_ids
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = self._tok.decode([token_id])
        if token_id in self._special:
            raw = list(text.encode("utf-8"))
        else:
            piece = self._tok.id_to_token(token_id)
            try:
                raw = [self._decoder[ch] for ch in piece]
            except KeyError:
                raw = list(text.encode("utf-8", errors="replace"))
        if len(self._cache) < 200_000:
            self._cache[token_id] = (text, raw)
        return text, raw


def check_text(value: Any, where: str) -> None:
    """Reject strings that cannot be UTF-8 (lone surrogates from JSON escapes such as \\ud800)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"{where} contains invalid Unicode (a lone surrogate)", param=where) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, where)
            check_text(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, f"{where}[{i}]")
