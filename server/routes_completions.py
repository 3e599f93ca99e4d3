"""POST /v1/completions: raw prompt(s) -> engine -> text.

``prompt`` is a string, a list of token ids, or a batch (a list of strings or of id lists, at most
64); each prompt is its own engine request, and its ``n`` choices get the indices
``prompt_index * n + i``. Prompt text may contain control-token text (``<｜User｜>``), which
encodes to the control token, as a raw completion prompt should. ``echo`` prefixes the prompt text
(no prompt logprobs: the engine does not compute them, so echo + logprobs is a 400). ``suffix`` is
not supported (400). Output text skips special tokens unless ``skip_special_tokens`` is false.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from flashtier.engine.outputs import CacheUsage
from flashtier.server.errors import APIError, BadRequest
from flashtier.server.metrics import RequestTracker
from flashtier.server.protocol import CompletionRequest, CompletionResponse
from flashtier.server.state import (
    ServerState,
    build_sampling_params,
    check_common,
    clamp_logprob,
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
    merge_outputs,
    sse_error,
    sse_event,
)

router = APIRouter()

THREAD_ENCODE_CHARS = 32_768


@dataclass
class CompletionChoiceState:
    index: int
    text: ChoiceText
    pieces: list[str] = field(default_factory=list)
    offset: int = 0  # characters of text so far (echo included), for text_offset
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def logprobs_of(self, state: ServerState, step: TextStep, k: int) -> dict[str, Any]:
        """Logprob lists for the step's tokens (appended to the choice's totals as well)."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in step.logprobs:
            text, _ = state.token_texts.get(lp.token_id)
            top = {state.token_texts.get(t)[0]: clamp_logprob(v) for t, v in lp.top[:k]}
            out["tokens"].append(text)
            out["token_logprobs"].append(clamp_logprob(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        self.tokens += out["tokens"]
        self.token_logprobs += out["token_logprobs"]
        self.top_logprobs += out["top_logprobs"]
        self.text_offset += out["text_offset"]
        return out


@dataclass
class CompletionRun:
    state: ServerState
    body: CompletionRequest
    request_id: str
    model: str
    streams: list[EngineStream]
    prompt_texts: list[str]  # for echo
    tracker: RequestTracker
    choices: list[CompletionChoiceState]
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    caches: dict[int, CacheUsage] = field(default_factory=dict)

    def choice_of(self, stream_index: int, delta_index: int) -> CompletionChoiceState:
        return self.choices[stream_index * self.body.n + delta_index]

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.get(i, len(s.prompt_token_ids)) for i, s in enumerate(self.streams))
        return usage_dict(prompt, sum(c.text.num_tokens for c in self.choices), 0,
                          sum_cache(list(self.caches.values())))

    def finish_metrics(self) -> None:
        for c in self.choices:
            c.text.abort()
        self.tracker.finish(completion_tokens=sum(c.text.num_tokens for c in self.choices),
                            finish_reasons=[c.text.finish_reason for c in self.choices],
                            max_tokens=self.streams[0].params.max_tokens, n=self.body.n)

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              with_usage_field: bool = False) -> bytes:
        payload: dict[str, Any] = {"id": self.request_id, "object": "text_completion", "created": self.created,
                                   "model": self.model, "choices": choices}
        if with_usage_field:
            payload["usage"] = usage
        return sse_event(json.dumps(payload, ensure_ascii=False))


async def _prompts(state: ServerState, prompt: Any) -> list[tuple[list[int], str]]:
    """(token ids, text) of every prompt in the request."""
    items: Sequence[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    vocab = state.tokenizer.vocab_size
    out = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            check_text(item, where)
            if len(item) > THREAD_ENCODE_CHARS:
                ids = await asyncio.to_thread(state.tokenizer.encode, item, True)
            else:
                ids = state.tokenizer.encode(item, allow_special=True)
            out.append((ids, item))
        else:
            bad = next((t for t in item if t >= vocab), None)
            if bad is not None:
                raise BadRequest(f"{where}: token id {bad} is out of range [0, {vocab})", param="prompt")
            out.append((list(item), ""))
    return out


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    tracker = state.metrics.tracker()
    engine = state.require_engine()
    model = state.resolve_model(body.model)
    check_common(state, body)
    if body.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise BadRequest("best_of must equal n (best-of sampling is not supported)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise BadRequest("echo with logprobs needs prompt logprobs, which are not supported", param="echo")
    prompts = await _prompts(state, body.prompt)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    stops = stop_strings(body.stop)
    streams, texts = [], []
    for i, (ids, text) in enumerate(prompts):
        max_tokens = resolve_max_tokens(len(ids), body.max_tokens, engine.max_model_len, prompt_param="prompt",
                                        tokens_param="max_tokens")
        params = build_sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs)
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        streams.append(EngineStream(engine, rid, ids, params, body.cache_salt))
        texts.append((text or state.tokenizer.decode(ids)) if body.echo else "")
    choices = [
        CompletionChoiceState(
            index=k,
            text=ChoiceText(state.tokenizer, stops=stops, include_stop=body.include_stop_str_in_output,
                            skip_special_tokens=body.skip_special_tokens, eos_token_id=engine.eos_token_id),
            offset=len(texts[k // body.n]),
        )
        for k in range(len(streams) * body.n)
    ]
    run = CompletionRun(state, body, request_id, model, streams, texts, tracker, choices)
    headers = {"X-Request-Id": request_id}
    if body.stream:
        try:
            for s in streams:
                await s.start()
        except BaseException:
            for s in streams:
                await s.close()
            raise
        return SSEResponse(_stream_completion(run), headers=headers)
    try:
        result = await cancel_on_disconnect(request, _complete(run))
    except ClientDisconnected:
        return Response(status_code=499)
    return JSONResponse(result, headers=headers)


async def _complete(run: CompletionRun) -> dict[str, Any]:
    k = run.body.logprobs
    try:
        async for i, out in merge_outputs(run.streams):
            run.tracker.on_output(out)
            run.prompt_tokens[i] = out.num_prompt_tokens
            if out.cache != CacheUsage() or i not in run.caches:
                run.caches[i] = out.cache
            for delta in out.choices:
                choice = run.choice_of(i, delta.index)
                step = choice.text.add(delta)
                choice.pieces.append(step.text)
                choice.token_ids.extend(delta.token_ids)
                if k is not None:
                    choice.logprobs_of(run.state, step, k)
            if all(c.text.finished for c in run.choices):
                break
    finally:
        for s in run.streams:
            await s.close()
        run.finish_metrics()
    return {
        "id": run.request_id, "object": "text_completion", "created": run.created, "model": run.model,
        "choices": [{
            "index": c.index,
            "text": run.prompt_texts[c.index // run.body.n] + "".join(c.pieces),
            "logprobs": None if k is None else {"tokens": c.tokens, "token_logprobs": c.token_logprobs,
                                                "top_logprobs": c.top_logprobs, "text_offset": c.text_offset},
            "finish_reason": c.text.finish_reason,
            "stop_reason": c.text.stop_reason,
            **({"prompt_token_ids": run.streams[c.index // run.body.n].prompt_token_ids,
                "token_ids": c.token_ids} if run.body.return_token_ids else {}),
        } for c in run.choices],
        "usage": run.usage(),
        "system_fingerprint": None,
    }


async def _stream_completion(run: CompletionRun) -> AsyncIterator[bytes]:
    opts = run.body.stream_options
    include_usage = bool(opts and opts.include_usage)
    k = run.body.logprobs
    try:
        if run.body.echo:
            for c in run.choices:
                yield run.chunk([{"index": c.index, "text": run.prompt_texts[c.index // run.body.n],
                                  "logprobs": None, "finish_reason": None}], None, include_usage)
        async for i, out in merge_outputs(run.streams):
            run.tracker.on_output(out)
            run.prompt_tokens[i] = out.num_prompt_tokens
            if out.cache != CacheUsage() or i not in run.caches:
                run.caches[i] = out.cache
            for delta in out.choices:
                choice = run.choice_of(i, delta.index)
                if choice.text.finished:
                    continue
                step = choice.text.add(delta)
                logprobs = choice.logprobs_of(run.state, step, k) if k is not None else None
                if step.text or logprobs:
                    yield run.chunk([{"index": choice.index, "text": step.text, "logprobs": logprobs,
                                      "finish_reason": None}], None, include_usage)
                if choice.text.finished:
                    yield run.chunk([{"index": choice.index, "text": "", "logprobs": None,
                                      "finish_reason": choice.text.finish_reason,
                                      "stop_reason": choice.text.stop_reason}], None, include_usage)
            if all(c.text.finished for c in run.choices):
                break
        for choice in run.choices:
            if not choice.text.finished:
                step = choice.text.abort()
                yield run.chunk([{"index": choice.index, "text": step.text, "logprobs": None,
                                  "finish_reason": "abort"}], None, include_usage)
        if include_usage:
            yield run.chunk([], run.usage(), True)
        yield SSE_DONE
    except APIError as exc:
        yield sse_error(exc)
        yield SSE_DONE
    except Exception:
        logger.exception("completion stream %s failed", run.request_id)
        yield sse_error(APIError(500, "internal server error; the details are in the server log"))
        yield SSE_DONE
    finally:
        for s in run.streams:
            await s.close()
        run.finish_metrics()
