"""A chat request's prompt: messages, tools and thinking mode -> V4.1 prompt ids (/v1/chat/completions
and /tokenize render it the same way).

Thinking: ``chat_template_kwargs.thinking`` (alias ``enable_thinking``) wins; else any
``reasoning_effort`` other than "none" turns it on (low/high/max = effort 50/75/100; OpenAI's
minimal/medium/xhigh map to low/high/max); else ``--default-thinking``.

Tools: ``tool_choice`` defaults to "auto" with tools, "none" without. The tools block is rendered
into the prompt even for "none" (the prompt prefix stays the same whatever the choice, so agent
histories keep hitting the prefix cache); with "none" the output is not parsed for calls.
"required" and a named function (which must be one of `tools`) are enforced by constrained decoding
(grammar/constraints.py, docs/structured_output.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashtier.server.text.chat_encoding import encode_to_ids
from flashtier.server.http.errors import BadRequest
from flashtier.server.protocol.request_models import ChatMessage, NamedToolChoice, Tool
from flashtier.server.serving.request_checks import check_text
from flashtier.server.serving.state import THREAD_ENCODE_CHARS, ServerState

__all__ = ["ChatPrompt", "Thinking", "ToolSetup", "render_chat", "resolve_thinking", "resolve_tools"]

EFFORT_LEVELS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    thinking: bool
    tools_enabled: bool  # parse the output for DSML calls


@dataclass(frozen=True)
class Thinking:
    enabled: bool
    effort: str | None  # the encoder's effort level (low | high | max), None for its default


@dataclass(frozen=True)
class ToolSetup:
    tools: list[dict[str, Any]] | None  # the tool schemas for the encoder
    parse_calls: bool  # look for DSML calls in the output


def resolve_thinking(default: bool, reasoning_effort: str | None, kwargs: dict[str, Any] | None) -> Thinking:
    """Thinking mode and effort level from the request fields."""
    kwargs = kwargs or {}
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("chat_template_kwargs.thinking must be a boolean", param="chat_template_kwargs")
    if thinking is None:
        thinking = default if reasoning_effort is None else reasoning_effort != "none"
    return Thinking(thinking, EFFORT_LEVELS.get(reasoning_effort or ""))


def resolve_tools(tools: list[Tool] | None, tool_choice: Any) -> ToolSetup:
    """The tool schemas and whether to parse calls; 400 on an inconsistent tool_choice."""
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    names = [t.function.name for t in tools or ()]
    if len(set(names)) != len(names):
        raise BadRequest("tools: function names must be unique", param="tools")
    choice = tool_choice if tool_choice is not None else ("auto" if tool_dicts else "none")
    if isinstance(choice, NamedToolChoice):
        if not tool_dicts:
            raise BadRequest("tool_choice names a function but no tools were given", param="tool_choice")
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                             f"({names})", param="tool_choice")
    elif choice == "required" and not tool_dicts:
        raise BadRequest('tool_choice "required" needs at least one tool', param="tool_choice")
    return ToolSetup(tool_dicts, bool(tool_dicts) and choice != "none")


def _text_chars(tree: Any) -> int:
    """Characters in every string of `tree` (keys included): a size that costs no copy of the text
    (``json.dumps`` of a 20 MB message held the event loop 170 ms)."""
    if isinstance(tree, str):
        return len(tree)
    if isinstance(tree, dict):
        return sum(len(k) + _text_chars(v) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return sum(_text_chars(v) for v in tree)
    return 0


async def render_chat(state: ServerState, messages: list[ChatMessage], *, tools: list[Tool] | None,
                      tool_choice: Any, reasoning_effort: str | None, chat_template_kwargs: dict[str, Any] | None,
                      add_generation_prompt: bool) -> ChatPrompt:
    """The prompt ids of a chat request (also used by /tokenize); 400 on anything unrenderable."""
    message_dicts = [m.model_dump(exclude_none=True) for m in messages]
    size = _text_chars(message_dicts)
    if size > THREAD_ENCODE_CHARS:  # checking 20 MB of text holds the loop ~40 ms: do it on the pool
        await state.cpu_pool.run(check_text, message_dicts, "messages")
    else:
        check_text(message_dicts, "messages")
    setup = resolve_tools(tools, tool_choice)
    check_text(setup.tools, "tools")
    thinking = resolve_thinking(state.settings.default_thinking, reasoning_effort, chat_template_kwargs)
    drop = (chat_template_kwargs or {}).get("drop_thinking", False)
    if not isinstance(drop, bool):
        raise BadRequest("chat_template_kwargs.drop_thinking must be a boolean", param="chat_template_kwargs")

    def encode() -> list[int]:
        return encode_to_ids(state.tokenizer, message_dicts, tools=setup.tools, thinking=thinking.enabled,
                             reasoning_effort=thinking.effort, add_generation_prompt=add_generation_prompt,
                             drop_thinking=drop)

    try:
        ids = await state.cpu_pool.run(encode) if size > THREAD_ENCODE_CHARS else encode()
    except ValueError as exc:
        raise BadRequest(str(exc), param="messages") from None
    return ChatPrompt(ids, thinking.enabled, setup.parse_calls)
