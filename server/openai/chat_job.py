"""A chat generation, built once for every API that speaks chat: /v1/chat/completions, /v1/responses and
/v1/messages translate their request into a ``ChatCompletionRequest`` and call ``prepare_chat_job``.

    ChatCompletionRequest ──checks──▶ render_chat (prompt ids) ──▶ SamplingParams (+ output constraint)
                                                         └──▶ one ChatChoiceState per choice ──▶ Generation

Everything that changes what the model may emit (tool_choice forcing, response_format, strict tools)
is decided here, so the three APIs cannot disagree. The route then renders the ``Generation`` in its own
shape (chat chunks, Responses events, Messages events) with its own renderer.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from flashtier.server.openai.chat_choice import ChatChoiceState
from flashtier.server.openai.chat_prompt import ChatPrompt, render_chat
from flashtier.server.text.choice_text import ChoiceText
from flashtier.server.grammar.constraints import chat_constraint
from flashtier.server.text.dsml import DsmlStreamParser
from flashtier.server.serving.engine_stream import EngineStream
from flashtier.server.http.errors import BadRequest
from flashtier.server.http.frontend_pool import INLINE_CHARS
from flashtier.server.serving.generation import Generation
from flashtier.server.protocol.request_models import ChatCompletionRequest
from flashtier.server.serving.request_checks import check_common, resolve_max_tokens
from flashtier.server.serving.state import ServerState, build_sampling_params, stop_strings

__all__ = ["ChatJob", "prepare_chat_job"]


@dataclass
class ChatJob:
    """A chat request ready to run: its prompt, the ``Generation`` (not started) and what renderers need."""

    request_id: str
    model: str
    prompt: ChatPrompt
    gen: Generation[ChatChoiceState]
    top_logprobs: int | None  # None: no logprobs requested


async def prepare_chat_job(state: ServerState, request: Request, body: ChatCompletionRequest, *,
                           request_id: str, chunk_object: str = "chat.completion.chunk") -> ChatJob:
    """Check `body`, render its prompt and build its Generation; 400/404/503 as ``APIError``.

    Mutates nothing but the metrics tracker it creates; the engine requests start only when the
    route calls ``stream_response`` / ``json_response`` (or ``gen.start()``).
    """
    tracker = state.metrics.tracker()
    engine = state.require_engine()
    model = state.resolve_model(body.model)
    check_common(state.settings, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    prompt = await render_chat(state, body.messages, tools=body.tools, tool_choice=body.tool_choice,
                               reasoning_effort=body.reasoning_effort,
                               chat_template_kwargs=body.chat_template_kwargs,
                               add_generation_prompt=body.add_generation_prompt)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    try:
        max_tokens = resolve_max_tokens(
            len(prompt.ids), requested, engine.max_model_len, prompt_param="messages",
            tokens_param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
            default=state.settings.max_tokens_default)
    except BadRequest:
        if len(prompt.ids) > INLINE_CHARS:  # a prompt too long for the model: freed on a worker, not the loop
            held = [prompt]
            del prompt
            state.cpu_pool.release_later(held)
        raise
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    spec = chat_constraint(body, body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = None
    if spec is not None:
        # thinking mode: the model reasons freely; the grammar holds from the token after </think>
        constraint = await state.grammars.compile(
            spec, vocab_size=engine.vocab_size, eos_token_id=engine.eos_token_id,
            begin_after_token=state.think_end_id if prompt.thinking else None)
    params = build_sampling_params(body, max_tokens=max_tokens, logprobs=top_logprobs, constraint=constraint)
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
    stream = EngineStream(engine, request_id, prompt.ids, params, state.cache_salt(request, body.cache_salt))
    gen = Generation(request_id, model, chunk_object, [stream], choices, tracker, state.drain)
    return ChatJob(request_id, model, prompt, gen, top_logprobs)
