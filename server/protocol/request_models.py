"""Pydantic models of the HTTP API's requests: OpenAI chat/completions, tokenize/detokenize.

Requests validate strictly (JSON types are not coerced: ``"max_tokens": "5"`` is a 400), reject
NaN/Infinity, and ignore fields they do not know (clients send many, e.g. ``metadata``, ``store``).
Ranges that depend on the deployment (``n`` against --max-n, prompt + max_tokens against the
context) are checked by the routes. Extensions beyond OpenAI carry vLLM's names (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``chat_template_kwargs``, ``cache_salt``).

Response models live in openai/response_models.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flashtier.engine.sample.params import MAX_LOGPROBS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:\-]{1,64}$"
CACHE_SALT_MAX_CHARS = 256


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


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


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``: the schema is enforced by constrained decoding."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs`` (exactly one of the constraint fields); the legacy top-level
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` map onto it."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = Field(default=False, description="JSON is written compact (no free "
                                         "whitespace); applies to response_format too")
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)


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
    # vLLM fields that change the answer: declared (not dropped) so that semantic_fields.py refuses them
    prompt_logprobs: Any = Field(default=None, description="not supported: 400 unless null")
    use_beam_search: Any = Field(default=None, description="not supported: 400 unless null or false")
    truncate_prompt_tokens: Any = Field(default=None, description="not supported: 400 unless null")
    allowed_token_ids: Any = Field(default=None, description="not supported: 400 unless null")
    bad_words: Any = Field(default=None, description="not supported: 400 unless null or empty")
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=CACHE_SALT_MAX_CHARS)] | None = Field(
        default=None, description="isolates this request's cached KV in every tier (hashed into the namespace of "
                                  "its blocks): 1 to 256 printable characters, no control characters")

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        default=None, description="vLLM's constrained decoding: exactly one of json, regex, choice, grammar, "
                                  "json_object")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="legacy alias of "
                                                     "structured_outputs.json")
    guided_regex: str | None = Field(default=None, description="legacy alias of structured_outputs.regex")
    guided_choice: list[str] | None = Field(default=None, description="legacy alias of structured_outputs.choice")
    guided_grammar: str | None = Field(default=None, description="legacy alias of structured_outputs.grammar")

    @field_validator("cache_salt")
    @classmethod
    def _printable_cache_salt(cls, value: str | None) -> str | None:
        if value is not None and not value.isprintable():  # NUL, control, format and unpaired surrogate chars
            bad = next(c for c in value if not c.isprintable())
            raise ValueError(f"must be 1 to {CACHE_SALT_MAX_CHARS} printable characters; it contains "
                             f"U+{ord(bad):04X} at index {value.index(bad)}")
        return value


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
    add_generation_prompt: bool = True
    return_token_ids: bool = Field(default=False, description="vLLM extension: the answer carries "
                                   "prompt_token_ids, each choice (or chunk) its token_ids")
    echo: Any = Field(default=None, description="vLLM's chat echo: not supported, 400 unless null or false")
    continue_final_message: Any = Field(default=None, description="not supported: 400 unless null or false")
    chat_template: Any = Field(default=None, description="not supported (the V4.1 template is built in): 400 "
                               "unless null")


# No max_length on prompt text: pydantic would build (and keep) a UTF-8 copy of the string to count it, 70 ms
# and 2x the memory for a 20 MB prompt; the body limits (--max-request-bytes, --max-tokenize-bytes) bound it.
PromptField = (
    str
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


class TokenizeRequest(_Request):
    """Either `prompt` (text, control tokens allowed) or `messages` (rendered as for chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 22)]
