"""A Responses request -> the ``ChatCompletionRequest`` that ``prepare_chat_job`` runs.

    instructions                        -> a leading system message (never inherited from an earlier turn)
    earlier conversation (previous_response_id: its input items + its output items), then `input`:
      message {role, content}           -> a message; input_text/output_text/refusal parts -> text parts
                                           (input_image / input_file / input_audio: 400, named)
      reasoning {content | encrypted}   -> reasoning_content of the assistant message that follows
      message role=assistant            -> that assistant message's content
      function_call {call_id, name, ..} -> its tool_calls (consecutive calls, with the reasoning and the
                                           assistant message before them, are ONE assistant turn: what the
                                           model wrote as one turn renders as one turn, so the prompt
                                           continues the previous one token for token)
      function_call_output {call_id}    -> a tool message
      item_reference {id}               -> the stored item (resolved before the translation)
    tools [{type: function, ...}]       -> chat tools; other kinds (web_search, mcp, ...) are dropped
    tool_choice                         -> the same string, {"type":"function","name"} -> a named function,
                                           allowed_tools -> its mode over the allowed function tools
    text.format                         -> response_format (json_schema / json_object)
    max_output_tokens, reasoning.effort, prompt_cache_key, user, temperature, top_p, parallel_tool_calls
                                        -> max_completion_tokens, reasoning_effort, cache_salt, ...

Enforcement (tool_choice, response_format) is prepare_chat_job's; this module only maps the fields.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from flashtier.server.http.errors import BadRequest, validation_message
from flashtier.server.protocol.request_models import ChatCompletionRequest
from flashtier.server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolIn,
    InputItem,
    ItemReference,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    decode_reasoning,
    parse_input_item,
    validate_as,
)

__all__ = ["ResponsesTranslation", "item_dict", "parse_input", "resolve_references", "translate"]

TEXT_PARTS = ("input_text", "output_text", "text")
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


@dataclass(frozen=True)
class ResponsesTranslation:
    chat: ChatCompletionRequest
    tools: list[dict[str, Any]]  # the function tools, in Responses' shape (echoed in the response)
    tool_choice: str | dict[str, Any]  # as echoed
    dropped_tools: list[str] = field(default_factory=list)  # the kinds of the tools left out


def parse_input(body: ResponsesRequest) -> list[InputItem]:
    """The request's own input items (a string is one user message); 400 naming a bad item."""
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)]
    return [parse_input_item(raw, f"input[{i}]") for i, raw in enumerate(body.input)]


async def resolve_references(items: Sequence[InputItem],
                             find: Callable[[str], Awaitable[dict[str, Any] | None]]) -> list[InputItem]:
    """`items` with each ``item_reference`` replaced by the item `find` returns; 400 when it finds none."""
    out: list[InputItem] = []
    for i, item in enumerate(items):
        if isinstance(item, ItemReference):
            raw = await find(item.id)
            resolved = parse_input_item(raw, f"input[{i}]") if raw is not None else None
            if resolved is None or isinstance(resolved, ItemReference):
                raise BadRequest(f"input[{i}]: item_reference {item.id!r} was not found (it must name an item "
                                 "of a stored response)", param=f"input[{i}].id")
            item = resolved
        out.append(item)
    return out


def item_dict(item: InputItem) -> dict[str, Any]:
    """An item as stored and sent back (``type`` always present)."""
    return item.model_dump(exclude_none=True, by_alias=True)


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return part["refusal"]
    if kind in UNSUPPORTED_PARTS:
        raise BadRequest(f"{where}: content parts of type {kind!r} are not supported (this server takes text "
                         "only)", param=where)
    raise BadRequest(f"{where}: unknown content part type {kind!r}; expected one of {list(TEXT_PARTS)} with a "
                     "string `text`", param=where)


def _content(content: str | list[dict[str, Any]], where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": _part_text(p, f"{where}.content[{j}]")} for j, p in enumerate(content)]


def _reasoning_text(item: ReasoningItem) -> str:
    """The reasoning to render: its reasoning_text content, else what this server put in encrypted_content
    (a summary is not the reasoning itself and is not rendered)."""
    if item.content:
        return "".join(c.text for c in item.content)
    return decode_reasoning(item.encrypted_content) or ""


def _where(i: int, own_start: int) -> str:
    return f"input[{i - own_start}]" if i >= own_start else f"previous_response_id (item {i})"


def _messages(instructions: str | None, items: Sequence[InputItem], own_start: int) -> list[dict[str, Any]]:
    """Chat messages for the conversation; see the module doc for how assistant turns are merged."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    turn: dict[str, Any] | None = None  # the assistant turn being assembled

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
            turn = None

    for i, item in enumerate(items):
        where = _where(i, own_start)
        if isinstance(item, ReasoningItem):
            if turn is not None and (turn["content"] or turn["tool_calls"]):
                flush()  # reasoning after an answer starts the next turn
            turn = turn or {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
            turn["reasoning_content"] += _reasoning_text(item)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            if turn is not None and (turn["content"] or turn["tool_calls"]):
                flush()
            turn = turn or {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
            turn["content"] = _content(item.content, where)
        elif isinstance(item, FunctionCallItem):
            turn = turn or {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}
            turn["tool_calls"].append({"id": item.call_id, "type": "function",
                                       "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            flush()
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output, where)})
        elif isinstance(item, MessageItem):
            flush()
            messages.append({"role": item.role, "content": _content(item.content, where)})
        else:  # an unresolved reference cannot get here: resolve_references runs first
            raise BadRequest(f"{where}: unresolved item_reference", param=where)
    flush()
    return messages


def _tools(raw: list[dict[str, Any]] | None) -> tuple[list[FunctionToolIn], list[str]]:
    """The function tools, and the kinds of the others (dropped: this server cannot run them)."""
    tools, dropped = [], []
    for i, tool in enumerate(raw or ()):
        kind = tool.get("type")
        if kind == "function":
            tools.append(validate_as(FunctionToolIn, tool, f"tools[{i}]"))
        elif isinstance(kind, str) and kind:
            dropped.append(kind)
        else:
            raise BadRequest(f"tools[{i}]: a tool needs a string `type`", param=f"tools[{i}].type")
    return tools, dropped


def _tool_choice(choice: Any, tools: list[FunctionToolIn]) -> tuple[Any, list[FunctionToolIn]]:
    """(chat tool_choice, the tools to offer) for a Responses tool_choice."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise BadRequest("tool_choice: a function choice needs a string `name`", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, tools
    if kind == "allowed_tools":
        mode, allowed = choice.get("mode", "auto"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise BadRequest("tool_choice: allowed_tools needs `mode` auto|required and a `tools` list",
                             param="tool_choice")
        names = {t.get("name") for t in allowed if isinstance(t, dict) and t.get("type") == "function"}
        return mode, [t for t in tools if t.name in names]
    raise BadRequest(f"tool_choice of type {kind!r} is not supported: this server runs function tools only",
                     param="tool_choice")


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if not fmt.name:
        raise BadRequest("text.format: a json_schema format needs a `name`", param="text.format.name")
    spec = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def translate(body: ResponsesRequest, conversation: Sequence[InputItem], own_start: int = 0) -> ResponsesTranslation:
    """The chat request for `body` over `conversation` (earlier turns, then this request's input from
    index `own_start`, references resolved).

    Pure; 400 (``BadRequest``) for what cannot be mapped.
    """
    tools, dropped = _tools(body.tools)
    choice, offered = _tool_choice(body.tool_choice, tools)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body.instructions, conversation, own_start),
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in offered] or None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "response_format": _response_format(body),
        "cache_salt": body.prompt_cache_key,
        "user": body.user,
    }
    try:
        request = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise BadRequest(message, param=param) from None
    echo_choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    echo_tools = [t.model_dump(exclude_none=True) for t in tools]
    return ResponsesTranslation(request, echo_tools, echo_choice, dropped)
