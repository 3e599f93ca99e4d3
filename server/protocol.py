"""Pydantic models of the HTTP API: OpenAI chat/completions/models, tokenize/detokenize, errors.

Requests validate strictly (JSON types are not coerced: ``"max_tokens": "5"`` is a 400), reject
NaN/Infinity, and ignore fields they do not know (clients send many, e.g. ``metadata``, ``store``).
Ranges that depend on the deployment (``n`` against --max-n, prompt + max_tokens against the
context) are checked by the routes. Extensions beyond OpenAI carry vLLM's names (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``chat_template_kwargs``, ``cache_salt``).

Responses are built from the models below, so the served OpenAPI document describes what the
server really returns. ``usage`` always carries ``prompt_tokens_details.cached_tokens`` and
``completion_tokens_details.reasoning_tokens``, and a ``flashtier`` object with the cached tokens by
tier and the replayed tokens of the request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flashtier.engine.sampling_params import MAX_LOGPROBS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:\-]{1,64}$"


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- chat messages ------------------------------------------------------------------------------------


class ContentPart(_Request):
    """A content part; only ``{"type": "text", "text": ...}`` is rendered, other types are a 400."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: str
    text: str | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(default=None, description="earlier reasoning (sent back by agents)")
    reasoning: str | None = Field(default=None, description="alias of reasoning_content")


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Request):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: Literal["text", "json_object", "json_schema"]


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
StopField = Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                             Field(max_length=32)]


class SamplingFields(_Request):
    """Fields shared by chat and completions (OpenAI + vLLM extras)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: StopField | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=256)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        default=None, description="isolates this request's prefix-cache entries (hashed into the first block)")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(default=None, description="deprecated alias of "
                                                           "max_completion_tokens")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: ReasoningEffort | None = Field(
        default=None, description="low | high | max (= effort 50/75/100, thinking on); minimal->low, "
                                  "medium->high, xhigh->max; none turns thinking off")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="`thinking` (alias `enable_thinking`): bool")
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True


PromptField = (
    Annotated[str, Field(max_length=1 << 26)]
    | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    | Annotated[list[str], Field(min_length=1, max_length=64)]
    | Annotated[list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
                Field(min_length=1, max_length=64)]
)


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM extension: choices carry prompt_token_ids and token_ids


# ---- responses ----------------------------------------------------------------------------------------


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class CachedTokensByTier(_Response):
    hbm: int = 0
    ssd: int = 0
    snapshot: int = 0


class FlashtierUsage(_Response):
    """Where the prompt came from: cached tokens by tier, tokens replayed (bounded replay), computed;
    and what the request persisted (SSD blocks + snapshots)."""

    cached_tokens_by_tier: CachedTokensByTier = Field(default_factory=CachedTokensByTier)
    replayed_tokens: int = 0
    computed_tokens: int = 0
    persisted_bytes: int = Field(default=0, description="bytes this request wrote to the persistent tiers")


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


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = Field(default=None, description="the stop string or token id that ended it")


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


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


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


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


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


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


class TokenizeRequest(_Request):
    """Either `prompt` (text, control tokens allowed) or `messages` (rendered as for chat)."""

    model: str | None = None
    prompt: Annotated[str, Field(max_length=1 << 26)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 22)]


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
