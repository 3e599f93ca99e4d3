"""Pydantic models of a ``POST /v1/responses`` request and of the input items it carries.

The request validates like chat's (strict JSON types, no NaN, unknown fields ignored). Its ``input``
stays a list of plain objects here because two item kinds have no ``type`` (an "easy" message has only
``role`` and ``content``; an item reference may have only ``id``); ``parse_input_item`` picks the item's
model and turns a validation failure into a 400 naming ``input[i]``. Which item kinds exist, and what
each becomes in the chat request, is in responses/translate.py.

Tools stay plain objects too: function tools are validated by ``FunctionToolIn`` there, the kinds this
server cannot run (web_search, mcp, ...) are dropped before anything validates them.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from flashtier.server.http.errors import BadRequest, validation_message
from flashtier.server.protocol.request_models import CACHE_SALT_MAX_CHARS, TOOL_NAME_PATTERN, ReasoningEffort

__all__ = [
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionToolIn",
    "InputItem",
    "ItemReference",
    "MessageItem",
    "ReasoningItem",
    "ResponsesRequest",
    "TextFormat",
    "decode_reasoning",
    "encode_reasoning",
    "parse_input_item",
    "validate_as",
]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)


# ---- input items ----------------------------------------------------------------------------------------


class MessageItem(_Model):
    """A message; ``content`` parts are checked (and unsupported kinds refused) by the translation."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class SummaryText(_Model):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningText(_Model):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class ItemReference(_Model):
    type: Literal["item_reference"] = "item_reference"
    id: str


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference
_ITEM_MODELS: dict[str, type[_Model]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem, "item_reference": ItemReference,
}


def validate_as(model: type[_Model], raw: Any, where: str) -> Any:
    """``model.model_validate(raw)``, a failure as a 400 whose message and param start with `where`."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        full = f"{where}.{param}" if param else where
        raise BadRequest(f"{where}.{message}" if param else f"{where}: {message}", param=full) from None


def parse_input_item(raw: Any, where: str) -> InputItem:
    """One input item by its ``type`` (a typeless one with ``role`` is a message, with only ``id`` a
    reference); 400 for an unknown type, naming it."""
    if not isinstance(raw, dict):
        raise BadRequest(f"{where}: an input item must be an object", param=where)
    kind = raw.get("type")
    if kind is None:
        kind = "message" if "role" in raw else "item_reference" if "id" in raw else None
    if not isinstance(kind, str) or kind not in _ITEM_MODELS:
        raise BadRequest(f"{where}: input items of type {kind!r} are not supported; this server accepts "
                         f"{sorted(_ITEM_MODELS)}", param=f"{where}.type")
    return validate_as(_ITEM_MODELS[kind], raw, where)


# ---- request fields -------------------------------------------------------------------------------------


class FunctionToolIn(_Model):
    """Responses' flat function tool (chat nests the same fields under ``function``)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Model):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(
        description="a string (one user message) or a list of input items")
    instructions: str | None = Field(default=None, description="a leading system message; not carried "
                                                                  "over through previous_response_id")
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, description="function tools; tool kinds the "
                                                                          "server cannot run are ignored")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    store: bool | None = None
    include: list[str] | None = None
    stream: bool | None = None
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=CACHE_SALT_MAX_CHARS)] | None = Field(
        default=None, description="isolates prompt-cache sharing (the chat API's cache_salt)")
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    background: bool | None = None
    # accepted so that they can be refused with a clear message rather than silently ignored
    conversation: Any = None
    prompt: Any = None

    @field_validator("prompt_cache_key")
    @classmethod
    def _printable_key(cls, value: str | None) -> str | None:
        if value is not None and not value.isprintable():
            raise ValueError(f"must be 1 to {CACHE_SALT_MAX_CHARS} printable characters")
        return value


# ---- reasoning carried by the client ------------------------------------------------------------------

# `include: ["reasoning.encrypted_content"]` returns a reasoning item's text in `encrypted_content`, so a
# client that stores nothing server-side (Codex with store=false) can send the reasoning back and the
# next prompt continues the last one token for token. It is encoded, not encrypted: the client already
# may see the reasoning text (it is in `content` too). Content from another server is ignored.
ENCRYPTED_PREFIX = "flashtier-reasoning-v1:"


def encode_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode("utf-8")).decode("ascii")


def decode_reasoning(blob: str | None) -> str | None:
    """The text in an ``encrypted_content`` this server wrote; None for anything else."""
    if not blob or not blob.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(blob[len(ENCRYPTED_PREFIX):], validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
