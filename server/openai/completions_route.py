"""POST /v1/completions: raw prompt(s) -> engine -> text.

``prompt`` is a string, a list of token ids, or a batch (a list of strings or of id lists, at most
64); each prompt is its own engine request, and its ``n`` choices get the indices
``prompt_index * n + i``. Prompt text may contain control-token text (``<｜User｜>``), which
encodes to the control token, as a raw completion prompt should. ``echo`` prefixes the prompt text
(no prompt logprobs: the engine does not compute them, so echo + logprobs is a 400). ``suffix`` is
not supported (400). Output text skips special tokens unless ``skip_special_tokens`` is false.
``max_tokens: null`` gets --max-tokens-default (capped by the context left).

Prompts longer than a few thousand characters (or ids) are checked, tokenized and (for ``echo``)
detokenized on the frontend pool; a large body was parsed there too (``PooledJSONRoute``).

The output loop is generation.py's; ``CompletionStreamRenderer`` sends ``text_completion`` chunks,
``CompletionBodyRenderer`` collects one ``text_completion`` answer.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from flashtier.server.text.choice_text import ChoiceText, TextStep
from flashtier.server.openai.completion_choice import CompletionChoiceState
from flashtier.server.grammar.constraints import completion_constraint
from flashtier.server.serving.engine_stream import EngineStream
from flashtier.server.http.errors import BadRequest
from flashtier.server.http.frontend_pool import INLINE_CHARS
from flashtier.server.serving.generation import Generation, json_response, stream_response
from flashtier.server.protocol.request_models import CompletionRequest
from flashtier.server.http.pooled_route import PooledJSONRoute
from flashtier.server.protocol.response_models import CompletionResponse
from flashtier.server.serving.request_checks import check_common, check_text, resolve_max_tokens
from flashtier.server.serving.state import ServerState, build_sampling_params, get_state, stop_strings

router = APIRouter(route_class=PooledJSONRoute)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # "" for a token-id prompt


async def _prompts(state: ServerState, prompt: Any) -> list[Prompt]:
    """Every prompt of the request."""
    items: Sequence[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    vocab = state.tokenizer.vocab_size
    out = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        work = (_encode_text if isinstance(item, str) else _check_ids, state, item, where, vocab)
        out.append(await state.cpu_pool.run(*work) if len(item) > INLINE_CHARS else work[0](*work[1:]))
    return out


def _encode_text(state: ServerState, text: str, where: str, vocab: int) -> Prompt:
    """A text prompt's ids (control-token text allowed); 400 on invalid Unicode."""
    check_text(text, where)
    return Prompt(state.tokenizer.encode(text, allow_special=True), text)


def _check_ids(state: ServerState, ids: list[int], where: str, vocab: int) -> Prompt:
    """A token-id prompt as it is (no copy); 400 naming the first id outside the vocabulary."""
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise BadRequest(f"{where}: token id {bad} is out of range [0, {vocab})", param="prompt")
    return Prompt(ids, "")


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    tracker = state.metrics.tracker()
    engine = state.require_engine()
    model = state.resolve_model(body.model)
    check_common(state.settings, body)
    if body.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise BadRequest("best_of must equal n (best-of sampling is not supported)", param="best_of")
    if body.echo and body.logprobs is not None:
        raise BadRequest("echo with logprobs needs prompt logprobs, which are not supported", param="echo")
    prompts = await _prompts(state, body.prompt)
    spec = completion_constraint(body)
    constraint = None if spec is None else await state.grammars.compile(
        spec, vocab_size=engine.vocab_size, eos_token_id=engine.eos_token_id, begin_after_token=None)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    stops = stop_strings(body.stop)
    streams, echoes = [], []
    salt = state.cache_salt(request, body.cache_salt)
    for i, prompt in enumerate(prompts):
        try:
            max_tokens = resolve_max_tokens(len(prompt.ids), body.max_tokens, engine.max_model_len,
                                            prompt_param="prompt", tokens_param="max_tokens",
                                            default=state.settings.max_tokens_default)
        except BadRequest:
            if sum(len(p.ids) for p in prompts) > INLINE_CHARS:  # freed on a worker, not the loop
                held = [*prompts]
                prompts.clear()
                del prompt
                state.cpu_pool.release_later(held)
            raise
        params = build_sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, constraint=constraint)
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        streams.append(EngineStream(engine, rid, prompt.ids, params, salt))
        echoes.append(await _echo_text(state, prompt) if body.echo else "")
    choices = [
        CompletionChoiceState(
            index=k,
            text=ChoiceText(state.tokenizer, stops=stops, include_stop=body.include_stop_str_in_output,
                            skip_special_tokens=body.skip_special_tokens, eos_token_id=engine.eos_token_id),
            offset=len(echoes[k // body.n]),
        )
        for k in range(len(streams) * body.n)
    ]
    gen = Generation(request_id, model, "text_completion", streams, choices, tracker, state.drain)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        renderer = CompletionStreamRenderer(gen, state, body.logprobs, echoes if body.echo else None, include_usage)
        return await stream_response(gen, renderer, include_usage=include_usage)
    return await json_response(request, gen, CompletionBodyRenderer(gen, state, body.logprobs, echoes,
                                                                     body.return_token_ids))


async def _echo_text(state: ServerState, prompt: Prompt) -> str:
    """The text `echo` puts before the completion: the prompt's text, or its ids decoded."""
    if prompt.text or len(prompt.ids) <= INLINE_CHARS:
        return prompt.text or state.tokenizer.decode(prompt.ids)
    return await state.cpu_pool.run(state.tokenizer.decode, prompt.ids)


@dataclass
class CompletionStreamRenderer:
    """``text_completion`` chunks: the echoed prompts, then each step's text (and logprobs)."""

    gen: Generation[CompletionChoiceState]
    state: ServerState
    logprobs: int | None
    echoes: list[str] | None  # per prompt, when echo is on
    include_usage: bool

    def head(self) -> Iterable[bytes]:
        if self.echoes is None:
            return ()
        return [self._chunk(c, self.echoes[c.index // self.gen.n], None, None) for c in self.gen.choices]

    def step(self, choice: CompletionChoiceState, step: TextStep) -> Iterable[bytes]:
        k = self.logprobs
        logprobs = choice.logprobs_of(self.state.token_texts, step, k) if k is not None else None
        chunks = []
        if step.text or logprobs:
            chunks.append(self._chunk(choice, step.text, logprobs, None))
        if choice.text.finished:
            chunks.append(self.gen.chunk([{"index": choice.index, "text": "", "logprobs": None,
                                           "finish_reason": choice.text.finish_reason,
                                           "stop_reason": choice.text.stop_reason}], None, self.include_usage))
        return chunks

    def abort(self, choice: CompletionChoiceState) -> Iterable[bytes]:
        return [self._chunk(choice, choice.text.abort().text, None, "abort")]

    def _chunk(self, choice: CompletionChoiceState, text: str, logprobs: dict[str, Any] | None,
               finish_reason: str | None) -> bytes:
        return self.gen.chunk([{"index": choice.index, "text": text, "logprobs": logprobs,
                                "finish_reason": finish_reason}], None, self.include_usage)


@dataclass
class CompletionBodyRenderer:
    """One ``text_completion``: each choice's text, logprobs and (on request) token ids."""

    gen: Generation[CompletionChoiceState]
    state: ServerState
    logprobs: int | None
    echoes: list[str]  # per prompt ("" without echo)
    return_token_ids: bool

    def step(self, choice: CompletionChoiceState, step: TextStep) -> Iterable[bytes]:
        choice.pieces.append(step.text)
        choice.token_ids.extend(step.token_ids)
        if self.logprobs is not None:
            choice.logprobs_of(self.state.token_texts, step, self.logprobs)
        return ()

    def abort(self, choice: CompletionChoiceState) -> Iterable[bytes]:
        choice.text.abort()  # the text it held back is not added to the answer
        return ()

    def body(self) -> dict[str, Any]:
        gen = self.gen
        return {"id": gen.request_id, "object": "text_completion", "created": gen.created, "model": gen.model,
                "choices": [self._choice(c) for c in gen.choices], "usage": gen.usage(), "system_fingerprint": None}

    def _choice(self, c: CompletionChoiceState) -> dict[str, Any]:
        stream = c.index // self.gen.n
        out = {"index": c.index, "text": self.echoes[stream] + "".join(c.pieces),
               "logprobs": None if self.logprobs is None else c.logprobs_dict(),
               "finish_reason": c.text.finish_reason, "stop_reason": c.text.stop_reason}
        if self.return_token_ids:
            out.update(prompt_token_ids=self.gen.streams[stream].prompt_token_ids, token_ids=c.token_ids)
        return out
