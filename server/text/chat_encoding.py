"""OpenAI chat messages -> DeepSeek V4.1 prompt text (a pure function; `encode_to_ids` also tokenizes).

The layout, for a system prompt, tools, thinking mode and one earlier tool-using turn, in the pieces that
are joined (`\\n` is a newline; there are no other line breaks; the effort line is shortened):

    <｜begin▁of▁sentence｜> <SYS> Reasoning Effort: 75 (range 1-100, higher values request ...)\\n\\n
    {system} \\n\\n ## Tools ...one JSON schema per line...\\n
    <｜User｜> {user} <｜Assistant｜><think>
    {reasoning} </think> {content} \\n\\n <｜DSML｜ calls>\\n...</｜DSML｜ calls> <｜end▁of▁sentence｜>
    <｜User｜> <tool_result>{result 1}</tool_result> \\n\\n <tool_result>{result 2}</tool_result> <｜Assistant｜><think>

<SYS> is `<｜System｜>` in the V4.1 tokenizer; the shipped V4 tokenizer lacks it, so `<｜begin▁sys｜>` stands in
(see `Tokenizer.system_marker`). Without thinking, the effort line is absent and every assistant header
ends in `</think>`. Consecutive user and tool messages form one user turn whose parts are joined by a blank
line, tool results sorted into the order of the calls they answer. A system message after the first one
is rendered in place behind its own marker and, like a user turn, opens the assistant header.

Earlier reasoning is kept by default (drop_thinking=False), so a history whose assistant turns are sent
back verbatim renders to the previous prompt + the generated text, token for token, and hits the prefix
cache. drop_thinking=True is the V4 reference default: reasoning of turns before the last user turn is
removed (and developer messages before it are dropped), except when tools are present.

Client text (every message field, tool schemas, call arguments) goes through `escape_control_text`, so a
literal `<｜User｜>` typed by a user stays text: a zero-width space is put after its first character.
Every assumption here is listed, with its source, in docs/encoding.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from flashtier.server.text.dsml_markup import (
    CALLS_CLOSE,
    CALLS_OPEN,
    CALLS_SEPARATOR,
    INVOKE_CLOSE,
    PARAM_CLOSE,
    render_tool_calls,
)
from flashtier.server.text.tokenizer import BOS_TEXT, EOS_TEXT, SYSTEM_FALLBACK_TEXT, THINK_END, THINK_START

if TYPE_CHECKING:
    from flashtier.server.text.tokenizer import Tokenizer

__all__ = [
    "EncodeOptions",
    "REASONING_EFFORT_LEVELS",
    "encode_messages",
    "encode_to_ids",
    "escape_control_text",
    "reasoning_effort_value",
    "render_tools_block",
]

USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

REASONING_EFFORT_LEVELS: Mapping[str, int] = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"
REASONING_EFFORT_LINE = "Reasoning Effort: {n} (range 1-100, higher values request more thorough reasoning)"

TOOL_RESULT = "<tool_result>{}</tool_result>"
PART_SEPARATOR = "\n\n"  # between content parts, merged user/tool parts, and before the tools block

# flashtier's own wording (docs/encoding.md, "Tools block"); the markup it shows is the V4.1 DSML.
TOOLS_BLOCK = f"""## Tools

You can call the tools described below. To call tools, end your reply with one block of this form:

{CALLS_OPEN}
<｜DSML｜ invoke name="TOOL_NAME">
<｜DSML｜ parameter name="PARAMETER_NAME" string="true|false">VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
...
{CALLS_CLOSE}

Write a string value exactly as it is, without quotes or escapes, and mark it string="true". Write any other \
value (number, boolean, null, array, object) as JSON and mark it string="false". Several invoke elements in \
one block call several tools.

In thinking mode, finish your reasoning with {THINK_END} before any tool call or answer. Otherwise, answer \
or call tools directly.

### Tool schemas

{{schemas}}

Only call the tools listed above, with parameters that follow their schemas.
"""

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# ---- escaping of client text --------------------------------------------------------------------------

ESCAPE_CHAR = "\u200b"  # ZERO WIDTH SPACE, put after the first character of a control-token text
# Token texts of the DeepSeek tokenizers: any `<｜name｜>` (this covers V4.1 additions such as `<｜System｜>`
# and `<｜deepseek_image｜>` that the shipped file lacks), plus the shipped file's other added tokens.
_CONTROL_RE = re.compile(
    r"<｜[^｜\s]{1,64}｜>?"
    r"|｜DSML｜"
    r"|</?think>"
    r"|</?dsml:"
    r"|<\|EOT\|>"
    r"|<\|place_holder_mm_span_\d+\|>"
)


def escape_control_text(text: str) -> str:
    """`text` with every control-token text broken by a zero-width space, so it tokenizes as characters.

    Text without such substrings is returned unchanged. Repeats until nothing matches, because breaking
    `<｜DSML｜>` at its `<` leaves the `｜DSML｜` token inside it.
    """
    while _has_control_text(text):
        text = _CONTROL_RE.sub(lambda m: m.group()[0] + ESCAPE_CHAR + m.group()[1:], text)
    return text


_SEARCH_STEP = 1 << 20  # characters per regex search: one search of a 20 MB prompt held the GIL 150 ms
_SEARCH_OVERLAP = 4096  # longer than any control-token text, so a match across a step boundary is found


def _has_control_text(text: str) -> bool:
    """Whether `text` holds a control-token text; searched a slice at a time, so the event loop (another
    thread) gets the GIL between slices."""
    return any(_CONTROL_RE.search(text, start, start + _SEARCH_STEP + _SEARCH_OVERLAP)
               for start in range(0, max(len(text), 1), _SEARCH_STEP))


# ---- message normalisation ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Turn:
    """One rendered unit: a message, or a run of user/tool messages merged into one user turn."""

    role: str  # system | developer | user | assistant
    text: str = ""  # escaped content (user: the joined parts)
    reasoning: str = ""  # assistant only, escaped
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # assistant: (name, arguments)
    call_ids: list[str] = field(default_factory=list)
    tools: str = ""  # rendered tools block (leading system message only)
    parts: list[tuple[str | None, str]] = field(default_factory=list)  # user: (tool_call_id or None, text)


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of OpenAI `text` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}: unsupported content part type {kind!r}; only 'text' parts are accepted")
        return PART_SEPARATOR.join(texts)
    raise ValueError(f"{where}: content must be a string, null or a list of text parts, not {type(content).__name__}")


def _tool_call(call: Any, where: str) -> tuple[str, str, dict[str, Any]]:
    """(id, name, arguments) of an OpenAI `tool_calls[]` entry; arguments is a JSON object string."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}: a tool call needs function.name")
    raw = function.get("arguments")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        arguments: Any = {}
    elif isinstance(raw, str):
        try:
            arguments = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{where}: function.arguments of {function['name']!r} is not valid JSON: {exc}") from None
    else:
        arguments = raw
    if not isinstance(arguments, Mapping):
        raise ValueError(f"{where}: function.arguments of {function['name']!r} must be a JSON object")
    return str(call.get("id") or ""), function["name"], dict(arguments)


def _tool_schema(tool: Any) -> dict[str, Any]:
    """The function object of an OpenAI tool ({"type": "function", "function": {...}}) or a bare one."""
    if isinstance(tool, Mapping) and tool.get("type", "function") == "function":
        function = tool.get("function", tool)
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return dict(function)
    raise ValueError(
        f"unsupported tool definition {tool!r}: expected {{'type': 'function', 'function': {{'name': ...}}}}"
    )


def render_tools_block(tools: Sequence[Any]) -> str:
    """The `## Tools` section: instructions plus one JSON schema per line (escaped client text)."""
    schemas = "\n".join(escape_control_text(json.dumps(_tool_schema(t), ensure_ascii=False)) for t in tools)
    return TOOLS_BLOCK.replace("{schemas}", schemas)


def _to_turns(messages: Sequence[Any], tools: Sequence[Any] | None) -> list[_Turn]:
    turns: list[_Turn] = []
    call_order: dict[str, int] = {}  # tool_call_id -> position in the latest assistant's calls
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where}: a message must be an object, not {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; expected one of {sorted(ROLES)}")
        text = escape_control_text(_content_text(msg.get("content"), where))
        if role in ("user", "tool"):
            if role == "tool":
                tool_call_id = msg.get("tool_call_id")
                part: tuple[str | None, str] = (str(tool_call_id or ""), TOOL_RESULT.format(text))
            else:
                part = (None, text)
            if not turns or turns[-1].role != "user":
                turns.append(_Turn("user"))
            turns[-1].parts.append(part)
        elif role == "assistant":
            reasoning = msg.get("reasoning_content")
            if reasoning is None:
                reasoning = msg.get("reasoning")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}: reasoning_content must be a string")
            turn = _Turn("assistant", text=text, reasoning=escape_control_text(reasoning or ""))
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"{where}: tool_calls must be a list")
            for call in calls:
                call_id, name, arguments = _tool_call(call, where)
                turn.call_ids.append(call_id)
                turn.calls.append((name, arguments))
            call_order = {cid: n for n, cid in enumerate(turn.call_ids) if cid}
            turns.append(turn)
        else:
            turns.append(_Turn(role, text=text))
        if role in ("user", "tool") and len(turns[-1].parts) > 1:
            _sort_tool_results(turns[-1], call_order)
    if tools:
        if not turns or turns[0].role != "system":
            turns.insert(0, _Turn("system"))
        turns[0].tools = render_tools_block(tools)
    for turn in turns:
        if turn.role == "user":
            turn.text = PART_SEPARATOR.join(text for _, text in turn.parts)
    return turns


def _sort_tool_results(turn: _Turn, call_order: Mapping[str, int]) -> None:
    """Reorder the tool results of a merged user turn into call order, in the slots tool results occupy.

    Results whose id matches no call keep their relative order after the matched ones.
    """
    slots = [n for n, (cid, _) in enumerate(turn.parts) if cid is not None]
    results = sorted((turn.parts[n] for n in slots), key=lambda p: call_order.get(p[0] or "", len(call_order)))
    for n, part in zip(slots, results, strict=True):
        turn.parts[n] = part


# ---- rendering ----------------------------------------------------------------------------------------


def reasoning_effort_value(reasoning_effort: str | int | None) -> int:
    """The N of the effort line: low/high/max -> 50/75/100, an int in [1, 100] as is, None -> high."""
    effort = DEFAULT_REASONING_EFFORT if reasoning_effort is None else reasoning_effort
    if isinstance(effort, bool):
        raise ValueError(f"invalid reasoning_effort {reasoning_effort!r}")
    if isinstance(effort, int):
        if 1 <= effort <= 100:
            return effort
    elif isinstance(effort, str) and effort in REASONING_EFFORT_LEVELS:
        return REASONING_EFFORT_LEVELS[effort]
    raise ValueError(
        f"invalid reasoning_effort {reasoning_effort!r}: expected one of {list(REASONING_EFFORT_LEVELS)} "
        "or an integer in [1, 100]"
    )


def _opens_assistant(turn: _Turn, index: int) -> bool:
    """Turns after which the model speaks: user, developer, and any system message but the first."""
    return turn.role in ("user", "developer") or (turn.role == "system" and index > 0)


def _drop_old_developer_turns(turns: list[_Turn]) -> list[_Turn]:
    """V4 reference `drop_thinking`, first half: developer turns before the last user turn are dropped."""
    last_user = _last_opener(turns)
    return [t for i, t in enumerate(turns) if not (i < last_user and t.role == "developer")]


def _last_opener(turns: Sequence[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if _opens_assistant(t, i)), default=-1)


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = False,
    reasoning_effort: str | int | None = None,
    add_generation_prompt: bool = True,
    drop_thinking: bool = False,
    system_marker: str = SYSTEM_FALLBACK_TEXT,
) -> str:
    """The prompt text for `messages` (OpenAI chat format), BOS included; the caller tokenizes it.

    Args:
        messages: dicts with role system | developer | user | assistant | tool. content is a string, None
            or a list of {"type": "text"} parts (joined by a blank line). assistant messages may carry
            reasoning_content (alias reasoning) and tool_calls; tool messages carry tool_call_id.
        tools: OpenAI tool definitions, rendered as a `## Tools` block in the (leading) system prompt; an
            empty system message is added in front when the conversation has none.
        thinking: thinking mode: the effort line opens the prompt and assistant headers end in `<think>`.
        reasoning_effort: "low" | "high" | "max" (50/75/100) or an int in [1, 100]; None means "high".
            Validated even when thinking is off, where it has no effect.
        add_generation_prompt: end with the assistant header when the last turn is one the model answers.
        drop_thinking: the V4 reference default (see module docstring); off keeps prefixes cache-stable.
        system_marker: the system-prompt token text; pass `tokenizer.system_marker` (encode_to_ids does).

    Raises:
        ValueError: empty conversation, unknown role, non-text content part, tool call arguments that are
            not a JSON object, bad reasoning_effort or tool definition.
    """
    if not messages:
        raise ValueError("messages must not be empty")
    effort = reasoning_effort_value(reasoning_effort)
    turns = _to_turns(messages, tools)
    # With drop, reasoning shows only after the last user turn (the turn being generated and its tool loop).
    drop = thinking and drop_thinking and not tools
    if drop:
        turns = _drop_old_developer_turns(turns)
    last_opener = _last_opener(turns)

    out = [BOS_TEXT]
    if thinking:
        out += [system_marker, REASONING_EFFORT_LINE.format(n=effort), PART_SEPARATOR]
    for i, turn in enumerate(turns):
        if turn.role == "system":
            if i > 0 or not thinking:
                out.append(system_marker)
            out.append(turn.text)
            if turn.tools:
                out += [PART_SEPARATOR, turn.tools]
        elif turn.role in ("user", "developer"):
            out += [USER, turn.text]
        else:
            if thinking and (not drop or i > last_opener):
                out += [turn.reasoning, THINK_END]
            out.append(turn.text)
            if turn.calls:
                out += [CALLS_SEPARATOR, render_tool_calls(turn.calls, escape=escape_control_text)]
            out.append(EOS_TEXT)
        is_last = i == len(turns) - 1
        if _opens_assistant(turn, i) and (turns[i + 1].role == "assistant" if not is_last else add_generation_prompt):
            think_open = thinking and (not drop or i >= last_opener)
            out += [ASSISTANT, THINK_START if think_open else THINK_END]
    return "".join(out)


class EncodeOptions(TypedDict, total=False):
    """The keywords of `encode_messages` that `encode_to_ids` passes on (all but system_marker)."""

    tools: Sequence[Mapping[str, Any]] | None
    thinking: bool
    reasoning_effort: str | int | None
    add_generation_prompt: bool
    drop_thinking: bool


def encode_to_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                  **options: Unpack[EncodeOptions]) -> list[int]:
    """`encode_messages` with the tokenizer's own system marker, tokenized (control tokens allowed)."""
    text = encode_messages(messages, system_marker=tokenizer.system_marker, **options)
    return tokenizer.encode(text, allow_special=True)
