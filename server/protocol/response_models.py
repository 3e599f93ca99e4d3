"""Pydantic models of the HTTP API's responses: chat/completions (and chunks), models, tokenize, errors.

Responses are built from these models, so the served OpenAPI document describes what the server
really returns. ``usage`` always carries ``prompt_tokens_details.cached_tokens`` and
``completion_tokens_details.reasoning_tokens``, and a ``flashtier`` object with the cached tokens by
tier, the replayed tokens and the resume provenance of the request.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class CachedTokensByTier(_Response):
    hbm: int = 0
    ssd: int = 0
    snapshot: int = 0


class ResumeUsage(_Response):
    """How the prompt's window state was made: exact (a snapshot or the full history), replay (the
    model's bounded replay from position ``replay_from``: approximate, never stored as exact), cold."""

    kind: Literal["exact", "replay", "cold"] = "cold"
    replay_from: int | None = None
    approximate: bool = Field(default=False, description='the window state is approximate (kind == "replay")')


class FlashtierUsage(_Response):
    """Where the prompt came from: cached tokens by tier, the decoder's tokens (its exact pass over the
    prompt's last window, every request), the encoder tokens of an approximate bounded replay (0 unless
    ``resume.kind`` is "replay"), computed tokens; what the request made durable so far (fsynced SSD
    blocks, Redis snapshots); its resume provenance."""

    cached_tokens_by_tier: CachedTokensByTier = Field(default_factory=CachedTokensByTier)
    decoder_tokens: int = Field(default=0, description="prompt tokens run through the decoder layers (exact)")
    approximate_replay_tokens: int = Field(
        default=0, description='encoder tokens re-run by a bounded replay (approximate); 0 unless resume.kind == "replay"')
    computed_tokens: int = 0
    persisted_bytes: int = Field(default=0, description="bytes of this request confirmed durable so far")
    resume: ResumeUsage = Field(default_factory=ResumeUsage)


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)
    flashtier: FlashtierUsage = Field(default_factory=FlashtierUsage)


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "tool_calls", "abort"]
ChoiceT = TypeVar("ChoiceT")


class _ChoicesResponse(_Response, Generic[ChoiceT]):
    """The leading fields, in this order, of a completion answer or a streamed chunk. A subclass narrows
    ``object`` (or requires ``usage``): a field redeclared there keeps its place here (the JSON and the
    OpenAPI document list it in this order)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChoiceT]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = Field(default=None, description="the stop string or token id that ended it")
    token_ids: list[int] | None = None  # with return_token_ids: the generated ids


class ChatCompletionResponse(_ChoicesResponse[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this step's ids (on the chunk that carries them)


class ChatCompletionChunk(_ChoicesResponse[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    prompt_token_ids: list[int] | None = None  # with return_token_ids: on the first chunk


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids: the generated ids (stop token excluded)


class CompletionResponse(_ChoicesResponse[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


# ---- models, tokenize, errors, health -----------------------------------------------------------------


class ModelExtension(_Response):
    demo: bool = False
    note: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashtier"
    root: str
    parent: str | None = None
    max_model_len: int | None = None
    flashtier: ModelExtension = Field(default_factory=ModelExtension)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"
