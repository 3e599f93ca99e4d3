"""POST /v1/chat/completions: messages -> V4.1 prompt ids -> engine -> reasoning, content, tool calls.

Per choice, the engine's token deltas go through ``ChoiceText`` (detokenization, stop strings) and
then ``DsmlStreamParser``, whose events become OpenAI fields:

    ReasoningDelta -> delta.reasoning_content (and the alias delta.reasoning)
    ContentDelta   -> delta.content
    ToolCallStart  -> delta.tool_calls[{index, id, type, function: {name, arguments: ""}}]
    ToolCallArgs   -> delta.tool_calls[{index, function: {arguments}}]   (fragments concatenate to JSON)

The non-streaming answer is built from the very same events, so both forms agree.

Thinking: ``chat_template_kwargs.thinking`` (alias ``enable_thinking``) wins; else any
``reasoning_effort`` other than "none" turns it on (low/high/max = effort 50/75/100; OpenAI's
minimal/medium/xhigh map to low/high/max); else ``--default-thinking``.

Tools: ``tool_choice`` defaults to "auto" with tools, "none" without. The tools block is rendered
into the prompt even for "none" (the prompt prefix stays the same whatever the choice, so agent
histories keep hitting the prefix cache); with "none" the output is not parsed for calls.
"required" and a named function are accepted but not enforced by constrained decoding; a named
function must be one of `tools`. ``parallel_tool_calls=false`` keeps only the first call.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from flashtier.engine.outputs import CacheUsage
from flashtier.server.chat_encoding import encode_to_ids
from flashtier.server.dsml import (
    ContentDelta,
    DsmlStreamParser,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallStart,
)
from flashtier.server.errors import APIError, BadRequest
from flashtier.server.metrics import RequestTracker
from flashtier.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    NamedToolChoice,
    Tool,
)
from flashtier.server.state import (
    ServerState,
    build_sampling_params,
    chat_logprob_entry,
    check_common,
    get_state,
    resolve_max_tokens,
    stop_strings,
    sum_cache,
    usage_dict,
)
from flashtier.server.streaming import (
    SSE_DONE,
    ChoiceText,
    ClientDisconnected,
    EngineStream,
    SSEResponse,
    TextStep,
    cancel_on_disconnect,
    check_text,
    logger,
    sse_error,
    sse_event,
)

router = APIRouter()

EFFORT_LEVELS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
# Prompts larger than this (characters) are encoded on a worker thread, off the event loop.
THREAD_ENCODE_CHARS = 32_768


# ---- prompt -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    thinking: bool
    tools_enabled: bool  # parse the output for DSML calls


def resolve_thinking(default: bool, reasoning_effort: str | None,
                     kwargs: dict[str, Any] | None) -> tuple[bool, str | None]:
    """(thinking on?, effort level for the encoder) from the request fields."""
    kwargs = kwargs or {}
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("chat_template_kwargs.thinking must be a boolean", param="chat_template_kwargs")
    if thinking is None:
        thinking = default if reasoning_effort is None else reasoning_effort != "none"
    return thinking, EFFORT_LEVELS.get(reasoning_effort or "")


def _tools_and_choice(tools: list[Tool] | None, tool_choice: Any) -> tuple[list[dict[str, Any]] | None, bool]:
    """(tool dicts for the encoder, whether to parse calls); 400 on an inconsistent tool_choice."""
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    names = [t.function.name for t in tools or ()]
    if len(set(names)) != len(names):
        raise BadRequest("tools: function names must be unique", param="tools")
    choice = tool_choice if tool_choice is not None else ("auto" if tool_dicts else "none")
    if isinstance(choice, NamedToolChoice):
        if not tool_dicts:
            raise BadRequest("tool_choice names a function but no tools were given", param="tool_choice")
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                             f"({names})", param="tool_choice")
    elif choice == "required" and not tool_dicts:
        raise BadRequest('tool_choice "required" needs at least one tool', param="tool_choice")
    return tool_dicts, bool(tool_dicts) and choice != "none"


async def render_chat(state: ServerState, messages: list[ChatMessage], *, tools: list[Tool] | None,
                      tool_choice: Any, reasoning_effort: str | None, chat_template_kwargs: dict[str, Any] | None,
                      add_generation_prompt: bool) -> ChatPrompt:
    """The prompt ids of a chat request (also used by /tokenize); 400 on anything unrenderable."""
    message_dicts = [m.model_dump(exclude_none=True) for m in messages]
    check_text(message_dicts, "messages")
    tool_dicts, tools_enabled = _tools_and_choice(tools, tool_choice)
    check_text(tool_dicts, "tools")
    thinking, effort = resolve_thinking(state.settings.default_thinking, reasoning_effort, chat_template_kwargs)
    drop = (chat_template_kwargs or {}).get("drop_thinking", False)
    if not isinstance(drop, bool):
        raise BadRequest("chat_template_kwargs.drop_thinking must be a boolean", param="chat_template_kwargs")

    def encode() -> list[int]:
        return encode_to_ids(state.tokenizer, message_dicts, tools=tool_dicts, thinking=thinking,
                             reasoning_effort=effort, add_generation_prompt=add_generation_prompt,
                             drop_thinking=drop)

    size = sum(len(json.dumps(m, ensure_ascii=False)) for m in message_dicts)
    try:
        ids = await asyncio.to_thread(encode) if size > THREAD_ENCODE_CHARS else encode()
    except ValueError as exc:
        raise BadRequest(str(exc), param="messages") from None
    return ChatPrompt(ids, thinking, tools_enabled)


# ---- one choice ---------------------------------------------------------------------------------------


@dataclass
class ChatChoiceState:
    """Text, parser and accounting of one choice."""

    index: int
    text: ChoiceText
    parser: DsmlStreamParser
    parallel_tool_calls: bool
    think_end_id: int | None
    in_reasoning: bool
    reasoning_tokens: int = 0
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)  # index -> [id, name, arguments]
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def step(self, step: TextStep) -> list[Event]:
        """Parser events for a TextStep (already applied to self.text); collects them too."""
        for tok in step.token_ids:
            if self.in_reasoning:
                if tok == self.think_end_id:
                    self.in_reasoning = False
                else:
                    self.reasoning_tokens += 1
        events = self.parser.feed(step.text) if step.text else []
        if step.finish_reason is not None:
            events += self.parser.finish()
        kept: list[Event] = []
        for ev in events:
            index = getattr(ev, "index", None)
            if index is not None and not self.parallel_tool_calls and index > 0:
                continue  # parallel_tool_calls=false: only the first call
            kept.append(ev)
            if isinstance(ev, ReasoningDelta):
                self.reasoning.append(ev.text)
            elif isinstance(ev, ContentDelta):
                self.content.append(ev.text)
            elif isinstance(ev, ToolCallStart):
                self.calls[ev.index] = [ev.id, ev.name, ""]
            elif isinstance(ev, ToolCallArgsDelta):
                self.calls[ev.index][2] += ev.text
        return kept

    @property
    def finish_reason(self) -> str | None:
        reason = self.text.finish_reason
        return "tool_calls" if reason == "stop" and self.calls else reason


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


# ---- the request --------------------------------------------------------------------------------------


@dataclass
class ChatRun:
    """Everything one chat request needs while its outputs come in."""

    state: ServerState
    body: ChatCompletionRequest
    request_id: str
    model: str
    prompt: ChatPrompt
    stream: EngineStream
    tracker: RequestTracker
    choices: list[ChatChoiceState]
    top_logprobs: int | None
    created: int = field(default_factory=lambda: int(time.time()))
    num_prompt_tokens: int = 0
    caches: dict[str, Any] = field(default_factory=dict)

    def observe(self, out: Any) -> None:
        self.tracker.on_output(out)
        self.num_prompt_tokens = out.num_prompt_tokens or len(self.prompt.ids)
        if out.cache != CacheUsage() or out.request_id not in self.caches:
            self.caches[out.request_id] = out.cache

    def usage(self) -> dict[str, Any]:
        return usage_dict(self.num_prompt_tokens or len(self.prompt.ids),
                          sum(c.text.num_tokens for c in self.choices),
                          sum(c.reasoning_tokens for c in self.choices),
                          sum_cache(list(self.caches.values())))

    def logprob_entries(self, step: TextStep) -> list[dict[str, Any]] | None:
        if self.top_logprobs is None:
            return None
        return [chat_logprob_entry(self.state.token_texts, lp, self.top_logprobs) for lp in step.logprobs]

    def finish_metrics(self) -> None:
        for choice in self.choices:
            if not choice.text.finished:
                choice.step(choice.text.abort())
        self.tracker.finish(completion_tokens=sum(c.text.num_tokens for c in self.choices),
                            finish_reasons=[c.text.finish_reason for c in self.choices],
                            max_tokens=self.stream.params.max_tokens, n=len(self.choices))

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              with_usage_field: bool = False) -> bytes:
        payload: dict[str, Any] = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                                   "model": self.model, "choices": choices}
        if with_usage_field:
            payload["usage"] = usage
        return sse_event(json.dumps(payload, ensure_ascii=False))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    tracker = state.metrics.tracker()
    engine = state.require_engine()
    model = state.resolve_model(body.model)
    check_common(state, body)
    if body.response_format is not None and body.response_format.type != "text":
        raise BadRequest(f"response_format {body.response_format.type!r} is not supported (no constrained "
                         "decoding yet)", param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    prompt = await render_chat(state, body.messages, tools=body.tools, tool_choice=body.tool_choice,
                               reasoning_effort=body.reasoning_effort,
                               chat_template_kwargs=body.chat_template_kwargs,
                               add_generation_prompt=body.add_generation_prompt)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = resolve_max_tokens(
        len(prompt.ids), requested, engine.max_model_len, prompt_param="messages",
        tokens_param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(body, max_tokens=max_tokens, logprobs=top_logprobs)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stops = stop_strings(body.stop)
    choices = [
        ChatChoiceState(
            index=i,
            text=ChoiceText(state.tokenizer, stops=stops, include_stop=body.include_stop_str_in_output,
                            eos_token_id=engine.eos_token_id),
            parser=DsmlStreamParser(prompt.thinking, prompt.tools_enabled),
            parallel_tool_calls=body.parallel_tool_calls,
            think_end_id=state.think_end_id,
            in_reasoning=prompt.thinking,
        )
        for i in range(body.n)
    ]
    stream = EngineStream(engine, request_id, prompt.ids, params, body.cache_salt)
    run = ChatRun(state, body, request_id, model, prompt, stream, tracker, choices, top_logprobs)
    headers = {"X-Request-Id": request_id}
    if body.stream:
        try:
            await stream.start()
        except BaseException:
            await stream.close()
            raise
        return SSEResponse(_stream_chat(run), headers=headers)
    try:
        result = await cancel_on_disconnect(request, _complete_chat(run))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(result, headers=headers)


async def _complete_chat(run: ChatRun) -> dict[str, Any]:
    try:
        async for out in run.stream.outputs():
            run.observe(out)
            for delta in out.choices:
                choice = run.choices[delta.index]
                step = choice.text.add(delta)
                choice.step(step)
                entries = run.logprob_entries(step)
                if entries:
                    choice.logprobs.extend(entries)
            if all(c.text.finished for c in run.choices):
                break
    finally:
        await run.stream.close()
        run.finish_metrics()
    result_choices = []
    for c in run.choices:
        calls = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                 for cid, name, args in (c.calls[k] for k in sorted(c.calls))]
        content = "".join(c.content)
        reasoning = "".join(c.reasoning) if run.prompt.thinking else None
        message = {"role": "assistant", "content": content if content or not calls else None,
                   "reasoning_content": reasoning, "reasoning": reasoning, "tool_calls": calls}
        result_choices.append({
            "index": c.index,
            "message": message,
            "logprobs": {"content": c.logprobs} if run.top_logprobs is not None else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.text.stop_reason,
        })
    return {"id": run.request_id, "object": "chat.completion", "created": run.created, "model": run.model,
            "choices": result_choices, "usage": run.usage(), "system_fingerprint": None}


async def _stream_chat(run: ChatRun) -> AsyncIterator[bytes]:
    opts = run.body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    try:
        for c in run.choices:
            yield run.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], with_usage_field=include_usage)
        async for out in run.stream.outputs():
            run.observe(out)
            for delta in out.choices:
                choice = run.choices[delta.index]
                if choice.text.finished:
                    continue
                step = choice.text.add(delta)
                events = choice.step(step)
                entries = run.logprob_entries(step)
                logprobs = {"content": entries} if entries else None
                usage = run.usage() if continuous else None
                for ev in events:
                    d = _delta_of(ev)
                    if d is None:
                        continue
                    yield run.chunk([{"index": choice.index, "delta": d, "logprobs": logprobs,
                                      "finish_reason": None}], usage, include_usage)
                    logprobs = None
                if logprobs is not None:
                    yield run.chunk([{"index": choice.index, "delta": {}, "logprobs": logprobs,
                                      "finish_reason": None}], usage, include_usage)
                if choice.text.finished:
                    yield run.chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                      "finish_reason": choice.finish_reason,
                                      "stop_reason": choice.text.stop_reason}], usage, include_usage)
            if all(c.text.finished for c in run.choices):
                break
        for choice in run.choices:  # the engine ended the request without finishing a choice
            if not choice.text.finished:
                for ev in choice.step(choice.text.abort()):
                    d = _delta_of(ev)
                    if d is not None:
                        yield run.chunk([{"index": choice.index, "delta": d, "logprobs": None,
                                          "finish_reason": None}], None, include_usage)
                yield run.chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                  "finish_reason": choice.finish_reason}], None, include_usage)
        if include_usage:
            yield run.chunk([], run.usage(), True)
        yield SSE_DONE
    except APIError as exc:
        yield sse_error(exc)
        yield SSE_DONE
    except Exception:
        logger.exception("chat stream %s failed", run.request_id)
        yield sse_error(APIError(500, "internal server error; the details are in the server log"))
        yield SSE_DONE
    finally:
        await run.stream.close()
        run.finish_metrics()
