"""An Anthropic Messages request -> the ``ChatCompletionRequest`` that ``prepare_chat_job`` runs.

    system (string or text blocks)          -> a leading system message (cache_control ignored)
    {"role": "system"} inside messages       -> a system message in place (tolerated)
    user text blocks                         -> a user message (blocks as text parts)
    user tool_result {tool_use_id, content}  -> a tool message (tool_call_id; text flattened; is_error
                                                prefixes "Error: "); blocks keep their order, so
                                                [tool_result, tool_result, text] is tool, tool, user
    assistant text / tool_use / thinking     -> content / tool_calls (arguments = json.dumps(input)) /
                                                reasoning_content (thinking texts joined)
    redacted_thinking                        -> dropped: its data is another provider's ciphertext
    image / document                         -> 400 "... not supported"
    tools [{name, description, input_schema}]-> function tools (parameters = input_schema); server tools
                                                (a type other than "custom") are ignored, logged once
    tool_choice auto | any | tool | none     -> "auto" | "required" | {"function": {"name"}} | "none";
                                                disable_parallel_tool_use -> parallel_tool_calls false
    thinking enabled | adaptive | disabled   -> chat_template_kwargs.thinking true | true | false;
                                                absent -> the server's --default-thinking
    output_config.effort (or effort)         -> reasoning_effort (low | medium | high | xhigh | max)
    output_config.format (or output_format)  -> response_format json_schema
    max_tokens, stop_sequences, temperature, top_p, top_k, stream -> the chat fields of the same meaning

A trailing assistant message (Anthropic's "prefill") is a 400: the V4.1 template closes every assistant
turn, so the model could not continue it. Every failure is a ``BadRequest``; nothing is mutated.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from flashtier.server.http.errors import BadRequest, validation_message
from flashtier.server.anthropic.protocol import (
    DocumentBlock,
    ImageBlock,
    InputMessage,
    MessagesPrompt,
    MessagesRequest,
    OutputFormat,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)
from flashtier.server.protocol.request_models import ChatCompletionRequest

__all__ = ["to_chat_request"]

logger = logging.getLogger(__name__)

_noted_server_tools: set[str] = set()  # server tool types already logged (once per process, not per request)


def _unsupported(block: ImageBlock | DocumentBlock, where: str) -> BadRequest:
    return BadRequest(f"{where}: {block.type} content blocks are not supported by this server (text only)",
                      param=where)


def _text_parts(blocks: list[Any], where: str) -> list[dict[str, str]]:
    """Chat text parts of text-only blocks (system, tool_result content); 400 on image/document."""
    parts = []
    for j, block in enumerate(blocks):
        if isinstance(block, (ImageBlock, DocumentBlock)):
            raise _unsupported(block, f"{where}[{j}]")
        text = getattr(block, "text", None)
        if not isinstance(text, str):  # tool_use / thinking / tool_result blocks have no place here
            raise BadRequest(f"{where}[{j}]: a {block.type} block is not allowed here (text blocks only)",
                             param=f"{where}[{j}]")
        parts.append({"type": "text", "text": text})
    return parts


def _tool_message(block: ToolResultBlock, where: str) -> dict[str, Any]:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        text = "\n\n".join(p["text"] for p in _text_parts(block.content, f"{where}.content"))
    if block.is_error:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _blocks(blocks: list[Any], where: str, allowed: tuple[type, ...], elsewhere: str) -> Iterator[tuple[str, Any]]:
    """``(path, block)`` for each of a message's content blocks, in order; 400 on an image/document block and
    on a type not in `allowed` (it "may only appear in `elsewhere`")."""
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, (ImageBlock, DocumentBlock)):
            raise _unsupported(block, at)
        if not isinstance(block, allowed):
            raise BadRequest(f"{at}: a {block.type} block may only appear in {elsewhere}", param=at)
        yield at, block


def _user_messages(msg: InputMessage, where: str) -> list[dict[str, Any]]:
    """Runs of text blocks become user messages and each tool_result a tool message, in block order."""
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for at, block in _blocks(msg.content, where, (TextBlock, ToolResultBlock), "an assistant message"):
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append(_tool_message(block, at))
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _assistant_message(msg: InputMessage, where: str) -> dict[str, Any]:
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    texts: list[dict[str, str]] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    allowed = (TextBlock, ToolUseBlock, ThinkingBlock, RedactedThinkingBlock)
    for _, block in _blocks(msg.content, where, allowed, "a user message"):
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        # a RedactedThinkingBlock is dropped: opaque to anyone but its issuer, nothing the model could read
    out: dict[str, Any] = {"role": "assistant", "content": texts or (None if calls else "")}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return out


def _messages(body: MessagesPrompt) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(body.system, str):
        if body.system:
            out.append({"role": "system", "content": body.system})
    elif body.system:
        out.append({"role": "system", "content": _text_parts(body.system, "system")})
    for i, msg in enumerate(body.messages):
        where = f"messages[{i}]"
        if msg.role == "user":
            out += _user_messages(msg, where)
        elif msg.role == "assistant":
            out.append(_assistant_message(msg, where))
        elif isinstance(msg.content, str):
            out.append({"role": "system", "content": msg.content})
        else:
            out.append({"role": "system", "content": _text_parts(msg.content, f"{where}.content")})
    if body.messages[-1].role == "assistant":
        raise BadRequest("a final assistant message (prefill) is not supported by this server; end with a user "
                         "message", param=f"messages[{len(body.messages) - 1}]")
    return out


def _tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    chat_tools = []
    for k, tool in enumerate(tools or ()):
        if tool.type not in (None, "custom"):
            if tool.type not in _noted_server_tools:
                _noted_server_tools.add(tool.type)
                logger.info("ignoring Anthropic server tool %r (type %s): only client tools are served",
                            tool.name, tool.type)
            continue
        if tool.input_schema is None:
            raise BadRequest(f"tools[{k}].input_schema: Field required", param=f"tools[{k}].input_schema")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        chat_tools.append({"type": "function", "function": function})
    return chat_tools or None


def _tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise BadRequest('tool_choice.name: required when tool_choice.type is "tool"', param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _response_format(fmt: OutputFormat | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.json_schema, "strict": True}}


def to_chat_request(body: MessagesPrompt, *, default_thinking: bool) -> ChatCompletionRequest:
    """The chat request `body` means (see the module doc); ``BadRequest`` (400) on what cannot be served.

    A count_tokens body (a bare ``MessagesPrompt``) carries no sampling fields; a ``MessagesRequest`` does.
    """
    thinking = default_thinking if body.thinking is None else body.thinking.type != "disabled"
    config = body.output_config
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "tools": _tools(body.tools),
        "tool_choice": _tool_choice(body.tool_choice),
        "chat_template_kwargs": {"thinking": thinking},
        "reasoning_effort": (config.effort if config and config.effort else None) or body.effort,
        "response_format": _response_format(config.format if config and config.format else body.output_format),
    }
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise BadRequest(message, param=param) from None
