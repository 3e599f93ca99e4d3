"""Pydantic models of Anthropic's Messages API requests (POST /v1/messages, /v1/messages/count_tokens).

Validation is strict as in protocol.py (no type coercion, no NaN/Infinity) and unknown fields are
ignored: Claude Code and the SDK send many this server has no use for (``metadata``, ``cache_control``,
``citations``, ``service_tier``, ``context_management``, ``container``, ``mcp_servers``, ...).
Content blocks are a union tagged by ``type``; an unknown tag is a 400 naming it. ``image`` and
``document`` blocks validate here so that anthropic/translate.py can reject them with a clear
"not supported" message. What each field becomes in chat terms is in anthropic/translate.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ContentBlock",
    "DocumentBlock",
    "ImageBlock",
    "InputMessage",
    "MessagesPrompt",
    "MessagesRequest",
    "OutputConfig",
    "OutputFormat",
    "RedactedThinkingBlock",
    "TextBlock",
    "ThinkingBlock",
    "ThinkingConfig",
    "ToolChoice",
    "ToolDefinition",
    "ToolResultBlock",
    "ToolUseBlock",
]

Effort = Literal["low", "medium", "high", "xhigh", "max"]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ImageBlock(_Model):
    type: Literal["image"]


class DocumentBlock(_Model):
    type: Literal["document"]


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ToolResultPart = Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool = False


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


_BLOCK_TYPES = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")


class InputMessage(_Model):
    # "system" is not Anthropic's (it has the top-level field) but some clients send it: tolerated.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_block_types(cls, value: Any) -> Any:
        """Name an unknown block type (pydantic's union error would only say "not a valid string")."""
        if isinstance(value, list):
            for j, block in enumerate(value):
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                    raise ValueError(f"block {j} has the type {kind!r}, which this server does not support "
                                     "(text, tool_use, tool_result, thinking and redacted_thinking are)")
        return value


class ToolDefinition(_Model):
    """A client tool (``type`` absent or "custom"), or an Anthropic server tool (any other type: ignored)."""

    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None  # accepted; the model has no token budget


class OutputFormat(_Model):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    effort: Effort | None = None
    format: OutputFormat | None = None


class MessagesPrompt(_Model):
    """What decides the prompt: the body of /v1/messages/count_tokens, and the base of MessagesRequest."""

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling of output_config.format
    effort: Effort | None = None  # a bare top-level effort; output_config.effort wins


class MessagesRequest(MessagesPrompt):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=32)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = None  # accepted, ignored
