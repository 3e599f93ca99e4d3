"""Anthropic's Messages API: POST /v1/messages, POST /v1/messages/count_tokens, and HEAD/GET / (clients
such as Claude Code probe the base URL).

A Messages request is translated into a ``ChatCompletionRequest`` (anthropic/translate.py) and run by
``prepare_chat_job``, the seam every chat-speaking API shares, so prompt rendering, checks and output
constraints are the chat route's. Only the rendering differs: ``MessageBodyRenderer`` folds the parser
events into one Message (anthropic/output.py), ``MessagesStreamRenderer`` streams the same fold as
Anthropic SSE events (anthropic/stream.py). Errors on these paths are in Anthropic's shape (errors.py
re-shapes by path). ``x-api-key`` is accepted as well as ``Authorization: Bearer`` (auth.py); the
``anthropic-version`` / ``anthropic-beta`` headers and the SDK's ``?beta=true`` are accepted and ignored.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from flashtier.server.openai.chat_choice import ChatChoiceState
from flashtier.server.openai.chat_job import prepare_chat_job
from flashtier.server.openai.chat_prompt import render_chat
from flashtier.server.text.choice_text import TextStep
from flashtier.server.http.errors import APIError
from flashtier.server.serving.generation import Generation, json_response
from flashtier.server.anthropic.output import ContentBlocks, messages_usage, stop_info
from flashtier.server.anthropic.protocol import MessagesPrompt, MessagesRequest
from flashtier.server.anthropic.stream import ABORTED, MessagesStreamRenderer, stream_messages
from flashtier.server.anthropic.translate import to_chat_request
from flashtier.server.http.pooled_route import PooledJSONRoute
from flashtier.server.protocol.request_models import ChatCompletionRequest
from flashtier.server.serving.state import THREAD_ENCODE_CHARS, ServerState, get_state

__all__ = ["MessageBodyRenderer", "router"]

router = APIRouter(route_class=PooledJSONRoute)  # large bodies are parsed off the event loop


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok", "models": list(get_state(request).settings.model_names)})


async def _translate(state: ServerState, request: Request, body: MessagesPrompt) -> ChatCompletionRequest:
    """``to_chat_request`` on a worker thread when the body is large: it re-validates every message."""
    try:
        size = int(request.headers.get("content-length", "0"))
    except ValueError:
        size = 0
    if size > THREAD_ENCODE_CHARS:
        return await state.cpu_pool.run(functools.partial(to_chat_request, body,
                                                          default_thinking=state.settings.default_thinking))
    return to_chat_request(body, default_thinking=state.settings.default_thinking)


# In /openapi.json with their errors in Anthropic's shape (app.py), so the schemathesis suite fuzzes them too.
@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = get_state(request)
    chat = await _translate(state, request, body)
    job = await prepare_chat_job(state, request, chat, request_id=f"msg_{uuid.uuid4().hex}", chunk_object="message")
    if body.stream:
        return await stream_messages(job.gen, MessagesStreamRenderer(job.gen))
    return await json_response(request, job.gen, MessageBodyRenderer(job.gen))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesPrompt, request: Request) -> JSONResponse:
    """The prompt length /v1/messages would send the engine; needs no engine, but the model must resolve."""
    state = get_state(request)
    state.resolve_model(body.model)
    chat = await _translate(state, request, body)
    prompt = await render_chat(state, chat.messages, tools=chat.tools, tool_choice=chat.tool_choice,
                               reasoning_effort=chat.reasoning_effort, chat_template_kwargs=chat.chat_template_kwargs,
                               add_generation_prompt=chat.add_generation_prompt)
    return JSONResponse({"input_tokens": len(prompt.ids)})


@dataclass
class MessageBodyRenderer:
    """One Message: the choice's events folded into content blocks; ``step``/``abort`` mutate the fold."""

    gen: Generation[ChatChoiceState]
    blocks: ContentBlocks = field(default_factory=ContentBlocks)
    aborted: bool = False

    def step(self, choice: ChatChoiceState, step: TextStep) -> Iterable[bytes]:
        self.blocks.feed(choice.step(step))
        return ()

    def abort(self, choice: ChatChoiceState) -> Iterable[bytes]:
        self.aborted = True
        self.blocks.feed(choice.abort())
        return ()

    def body(self) -> dict[str, Any]:
        """The Message; an unfinished generation has no stop reason to give, so it is a 503 instead."""
        gen = self.gen
        stop = stop_info(gen.choices[0])
        if self.aborted or stop.reason is None:
            raise APIError(503, ABORTED)
        self.blocks.close()
        return {"id": gen.request_id, "type": "message", "role": "assistant", "model": gen.model,
                "content": self.blocks.content(), "stop_reason": stop.reason, "stop_sequence": stop.sequence,
                "usage": messages_usage(gen.usage())}
