"""POST /v1/chat/completions: messages -> V4.1 prompt ids -> engine -> reasoning, content, tool calls.

Per choice, the engine's token deltas go through ``ChoiceText`` (detokenization, stop strings) and
then ``DsmlStreamParser`` (chat_choice.py), whose events become OpenAI fields:

    ReasoningDelta -> delta.reasoning_content (and the alias delta.reasoning)
    ContentDelta   -> delta.content
    ToolCallStart  -> delta.tool_calls[{index, id, type, function: {name, arguments: ""}}]
    ToolCallArgs   -> delta.tool_calls[{index, function: {arguments}}]   (fragments concatenate to JSON)

One output loop (generation.py) drives two renderers: ``ChatStreamRenderer`` sends those deltas as SSE
chunks, ``ChatBodyRenderer`` folds the very same events into one message, so both forms agree. How the
prompt is rendered (thinking mode, tools, tool_choice) is in chat_prompt.py;
``parallel_tool_calls=false`` keeps only the first call. A call cut off by ``max_tokens`` after its name
arrives with the last step, its arguments the (possibly incomplete) JSON written so far, and the choice
ends with "length"; no DSML markup is ever sent (chat_choice.py, dsml.py).

``return_token_ids`` (vLLM's extension): the answer carries ``prompt_token_ids`` and each choice its
``token_ids``; a stream carries ``prompt_token_ids`` in its first chunk and each step's ids on the first
chunk of that step (an empty delta when the step shows no text), so the streamed ids concatenate to
the completion's. A large body is parsed and validated off the event loop (``PooledJSONRoute``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from flashtier.server.openai.chat_choice import ChatChoiceState
from flashtier.server.openai.chat_job import prepare_chat_job
from flashtier.server.text.choice_text import TextStep
from flashtier.server.text.dsml_events import ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from flashtier.server.serving.generation import Generation, json_response, stream_response
from flashtier.server.http.pooled_route import PooledJSONRoute
from flashtier.server.protocol.request_models import ChatCompletionRequest
from flashtier.server.protocol.response_models import ChatCompletionResponse
from flashtier.server.http.sse import sse_event
from flashtier.server.serving.state import ServerState, chat_logprob_entry, get_state

router = APIRouter(route_class=PooledJSONRoute)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    job = await prepare_chat_job(state, request, body, request_id=f"chatcmpl-{uuid.uuid4().hex}")
    gen, top_logprobs = job.gen, job.top_logprobs
    if body.stream:
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        renderer = ChatStreamRenderer(gen, state, top_logprobs, include_usage, continuous, body.return_token_ids)
        return await stream_response(gen, renderer, include_usage=include_usage)
    return await json_response(request, gen, ChatBodyRenderer(gen, state, top_logprobs, job.prompt.thinking,
                                                              body.return_token_ids))


def _logprob_entries(state: ServerState, top_logprobs: int | None, step: TextStep) -> list[dict[str, Any]] | None:
    if top_logprobs is None:
        return None
    return [chat_logprob_entry(state.token_texts, lp, top_logprobs) for lp in step.logprobs]


def _delta_of(ev: Event) -> dict[str, Any] | None:
    if isinstance(ev, ReasoningDelta):
        return {"reasoning_content": ev.text, "reasoning": ev.text}
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    if isinstance(ev, ToolCallArgsDelta):
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}
    return None  # ToolCallEnd


@dataclass
class ChatStreamRenderer:
    """``chat.completion.chunk`` events: the assistant role, then one chunk per parser event."""

    gen: Generation[ChatChoiceState]
    state: ServerState
    top_logprobs: int | None
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool = False

    def head(self) -> Iterable[bytes]:
        heads = [[{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}] for c in self.gen.choices]
        if not self.return_token_ids:
            return [self.gen.chunk(choices, with_usage_field=self.include_usage) for choices in heads]
        gen = self.gen
        payload = {"id": gen.request_id, "object": gen.chunk_object, "created": gen.created, "model": gen.model,
                   "prompt_token_ids": gen.streams[0].prompt_token_ids}
        usage = {"usage": None} if self.include_usage else {}
        return [sse_event(json.dumps({**payload, "choices": choices, **usage}, ensure_ascii=False))
                for choices in heads]

    def step(self, choice: ChatChoiceState, step: TextStep) -> Iterable[bytes]:
        events = choice.step(step)
        entries = _logprob_entries(self.state, self.top_logprobs, step)
        logprobs = {"content": entries} if entries else None
        usage = self.gen.usage() if self.continuous_usage else None
        ids = list(step.token_ids) if self.return_token_ids and step.token_ids else None
        chunks = []
        for ev in events:
            d = _delta_of(ev)
            if d is None:
                continue
            chunks.append(self._chunk(choice, d, logprobs, usage, ids))
            logprobs = ids = None
        if logprobs is not None or ids is not None:
            chunks.append(self._chunk(choice, {}, logprobs, usage, ids))
        if choice.text.finished:
            chunks.append(self.gen.chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                           "finish_reason": choice.finish_reason,
                                           "stop_reason": choice.text.stop_reason}], usage, self.include_usage))
        return chunks

    def abort(self, choice: ChatChoiceState) -> Iterable[bytes]:
        chunks = [self._chunk(choice, d, None, None) for d in map(_delta_of, choice.abort()) if d is not None]
        chunks.append(self.gen.chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                       "finish_reason": choice.finish_reason}], None, self.include_usage))
        return chunks

    def _chunk(self, choice: ChatChoiceState, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               usage: dict[str, Any] | None, token_ids: list[int] | None = None) -> bytes:
        entry = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        if token_ids is not None:
            entry["token_ids"] = token_ids
        return self.gen.chunk([entry], usage, self.include_usage)


@dataclass
class ChatBodyRenderer:
    """One ``chat.completion``: each choice's events folded into its message."""

    gen: Generation[ChatChoiceState]
    state: ServerState
    top_logprobs: int | None
    thinking: bool
    return_token_ids: bool = False

    def step(self, choice: ChatChoiceState, step: TextStep) -> Iterable[bytes]:
        choice.step(step)
        entries = _logprob_entries(self.state, self.top_logprobs, step)
        if entries:
            choice.logprobs.extend(entries)
        return ()

    def abort(self, choice: ChatChoiceState) -> Iterable[bytes]:
        choice.abort()
        return ()

    def body(self) -> dict[str, Any]:
        gen = self.gen
        out = {"id": gen.request_id, "object": "chat.completion", "created": gen.created, "model": gen.model,
               "choices": [self._choice(c) for c in gen.choices], "usage": gen.usage(), "system_fingerprint": None}
        if self.return_token_ids:
            out["prompt_token_ids"] = gen.streams[0].prompt_token_ids
        return out

    def _choice(self, c: ChatChoiceState) -> dict[str, Any]:
        answer = c.answer.build()
        calls = [call.to_openai() for call in answer.tool_calls]
        reasoning = answer.reasoning if self.thinking else None
        message = {"role": "assistant", "content": answer.content if answer.content or not calls else None,
                   "reasoning_content": reasoning, "reasoning": reasoning, "tool_calls": calls}
        out = {"index": c.index, "message": message,
               "logprobs": {"content": c.logprobs} if self.top_logprobs is not None else None,
               "finish_reason": c.finish_reason, "stop_reason": c.text.stop_reason}
        if self.return_token_ids:
            out["token_ids"] = c.text.token_ids
        return out
