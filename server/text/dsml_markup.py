"""DSML, the DeepSeek V4.1 tool-call markup: its tags, writing a calls block, reading one invoke.

An assistant turn as the model writes it (thinking mode; without thinking the `...</think>` part is absent
because the prompt already ends in `</think>`):

    {reasoning}</think>{content}\\n\\n<｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls><｜end▁of▁sentence｜>

`｜DSML｜` is one token (U+FF5C bars); the tag names after it start with a space (the V4.1 spelling; V4 had
`tool_calls`/`invoke`/`parameter` without it). string="true" marks a raw string value, string="false" a
JSON value. This module owns the markup: `render_tool_calls` writes it (chat_encoding uses it for echoed
assistant turns), `parse_invoke` reads one complete invoke back and `parse_invoke_prefix` reads what an
invoke cut off (by `max_tokens`) holds so far; the stream parser (dsml.py) finds the blocks in model output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flashtier.server.text.held_suffix import held_suffix

__all__ = [
    "CALLS_CLOSE",
    "CALLS_OPEN",
    "CALLS_SEPARATOR",
    "INVOKE_CLOSE",
    "INVOKE_OPEN",
    "PARAM_CLOSE",
    "PARAM_OPEN",
    "WHITESPACE",
    "Invoke",
    "parse_invoke",
    "parse_invoke_prefix",
    "render_tool_calls",
]

DSML_TOKEN = "｜DSML｜"
CALLS_OPEN = f"<{DSML_TOKEN} calls>"
CALLS_CLOSE = f"</{DSML_TOKEN} calls>"
INVOKE_OPEN = f"<{DSML_TOKEN} invoke"
INVOKE_CLOSE = f"</{DSML_TOKEN} invoke>"
PARAM_OPEN = f"<{DSML_TOKEN} parameter"
PARAM_CLOSE = f"</{DSML_TOKEN} parameter>"
# The encoder puts a blank line between an assistant turn's content and its calls block, even when the
# content is empty; the parser strips exactly this separator from the content.
CALLS_SEPARATOR = "\n\n"

_INVOKE_HEAD_RE = re.compile(rf'<{DSML_TOKEN} invoke\s+name="([^"\n]+)"\s*>')
_INVOKE_NAME_RE = re.compile(rf'<{DSML_TOKEN} invoke\s+name="([^"\n]+)"\s*')  # the head up to its `>`
_PARAM_HEAD_RE = re.compile(rf'<{DSML_TOKEN} parameter\s+name="([^"\n]+)"(?:\s+string="(true|false)")?\s*>')
WHITESPACE = " \t\r\n"  # what may stand between the tags of a calls block


@dataclass(frozen=True, slots=True)
class Invoke:
    """One parsed `<｜DSML｜ invoke>`: the function name and its arguments as a JSON object text."""

    name: str
    arguments: str


def _identity(text: str) -> str:
    return text


def render_tool_calls(calls: Iterable[tuple[str, Mapping[str, Any]]], escape: Callable[[str], str] = _identity) -> str:
    """The `<｜DSML｜ calls>` block (without the leading separator) for (name, arguments) pairs.

    A str value is written raw with string="true"; anything else as JSON with string="false". `escape` is
    applied to every client-supplied piece (names and values) so that text inside them cannot form a
    control token (chat_encoding passes its escaper).
    """
    invokes = []
    for name, arguments in calls:
        params = []
        for key, value in arguments.items():
            is_str = isinstance(value, str)
            text = value if is_str else json.dumps(value, ensure_ascii=False)
            flag = "true" if is_str else "false"
            params.append(f'{PARAM_OPEN} name="{escape(key)}" string="{flag}">{escape(text)}{PARAM_CLOSE}')
        invokes.append(f'{INVOKE_OPEN} name="{escape(name)}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return f"{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value(text: str) -> str | None:
    """`text` stripped when it is one strict JSON value (no NaN/Infinity), else None."""
    text = text.strip(WHITESPACE)
    try:
        json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return None
    return text


def parse_invoke(text: str) -> Invoke | None:
    """Name and arguments of one complete `<｜DSML｜ invoke ...>...</｜DSML｜ invoke>`, None if malformed."""
    head = _INVOKE_HEAD_RE.match(text)
    if head is None:
        return None
    body = text[head.end() : len(text) - len(INVOKE_CLOSE)]
    members: dict[str, str] = {}
    pos = 0
    while True:
        while pos < len(body) and body[pos] in WHITESPACE:
            pos += 1
        if pos == len(body):
            break
        param = _PARAM_HEAD_RE.match(body, pos)
        if param is None:
            # A JSON object body (what grammar-constrained decoding may produce) is accepted in place of
            # parameter tags, but not mixed with them.
            if members or (obj := _json_value(body)) is None or not obj.startswith("{"):
                return None
            return Invoke(head.group(1), obj)
        end = body.find(PARAM_CLOSE, param.end())
        key, string_attr = param.group(1), param.group(2)
        if end < 0 or key in members:
            return None
        raw = body[param.end() : end]
        as_json = None if string_attr == "true" else _json_value(raw)
        # string="false" with a value that is not JSON (`True`, bare words) is kept as the string it is.
        members[key] = as_json if as_json is not None else json.dumps(raw, ensure_ascii=False)
        pos = end + len(PARAM_CLOSE)
    return Invoke(head.group(1), _arguments_prefix(list(members.items())) + "}")


def _arguments_prefix(members: list[tuple[str, str]]) -> str:
    """`parse_invoke`'s arguments text for `members` (key, JSON value text), without the closing brace."""
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in members)


def parse_invoke_prefix(text: str) -> Invoke | None:
    """What an invoke cut off before its `</｜DSML｜ invoke>` holds: its name and the arguments so far.

    `text` starts with `<｜DSML｜ invoke` and is the whole rest of the output (the generation stopped there).
    None while the name is not complete (its closing quote has not arrived) or when the head does not
    parse. Otherwise `arguments` is the start of the JSON object text `parse_invoke` would give once the
    invoke closed the way it is going: the complete parameters, then the current one's key and value so
    far once its head is complete (a raw string value JSON-escaped without its closing quote; a JSON value
    as written), never a closing brace, and never a piece of markup (a partial closing tag at the end is
    left out). Parsing stops at the first thing that is neither a parameter nor the start of one (what
    follows is not reported). Linear in `len(text)`; mutates nothing.
    """
    head = _INVOKE_NAME_RE.match(text)
    if head is None:
        return None
    name = head.group(1)
    if head.end() == len(text):
        return Invoke(name, "{")
    if text[head.end()] != ">":
        return None  # not an invoke head after all: malformed
    body = text[head.end() + 1 :]
    members: list[tuple[str, str]] = []
    keys: set[str] = set()
    pos = 0
    while True:
        while pos < len(body) and body[pos] in WHITESPACE:
            pos += 1
        if pos == len(body):
            return Invoke(name, _arguments_prefix(members))
        param = _PARAM_HEAD_RE.match(body, pos)
        if param is None:
            rest = body[pos:]
            if not members and rest.startswith("{"):  # a JSON object body, as parse_invoke accepts
                rest = rest[: len(rest) - held_suffix(rest, (INVOKE_CLOSE,))]
                return Invoke(name, rest.rstrip(WHITESPACE))
            return Invoke(name, _arguments_prefix(members))  # a tag still arriving (or not parsing)
        key, string_attr = param.group(1), param.group(2)
        if key in keys:
            return Invoke(name, _arguments_prefix(members))
        keys.add(key)
        end = body.find(PARAM_CLOSE, param.end())
        if end >= 0:
            raw = body[param.end() : end]
            as_json = None if string_attr == "true" else _json_value(raw)
            members.append((key, as_json if as_json is not None else json.dumps(raw, ensure_ascii=False)))
            pos = end + len(PARAM_CLOSE)
            continue
        raw = body[param.end() :]
        raw = raw[: len(raw) - held_suffix(raw, (PARAM_CLOSE,))]
        if string_attr == "true":
            value = json.dumps(raw, ensure_ascii=False)[:-1]  # the escaped text so far, still open
        else:
            value = raw.strip(WHITESPACE)
        key_text = json.dumps(key, ensure_ascii=False)
        head_text = _arguments_prefix(members) + (", " if members else "") + f"{key_text}: "
        return Invoke(name, head_text + value)
