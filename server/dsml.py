"""DSML, the DeepSeek V4.1 tool-call markup: rendering it into prompts and parsing it out of model output.

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
JSON value. This module owns that format: `render_tool_calls` writes it (chat_encoding uses it for echoed
assistant turns) and `DsmlStreamParser` / `parse_completion` read it back.

Streaming contract. `DsmlStreamParser.feed` accepts the output text split at any character boundary and
returns typed events; text that might be the start of a marker (`</thi`, `\\n\\n<｜DS`, the EOS text) is held
back until the next delta decides it. Concatenating the events of any chunking gives the same result as
`parse_completion` on the whole text. A tool call's events (start, arguments, end) are emitted together
once its `</｜DSML｜ invoke>` arrives: the arguments are only known to be well formed then, and an event
already sent cannot be taken back. Malformed or unterminated markup never raises: from the first point
that does not parse, the raw text is emitted as content.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "CALLS_CLOSE",
    "CALLS_OPEN",
    "CALLS_SEPARATOR",
    "ContentDelta",
    "DsmlStreamParser",
    "Event",
    "ParsedCompletion",
    "ReasoningDelta",
    "ToolCall",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "make_call_id",
    "parse_completion",
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
THINK_END = "</think>"
EOS_TEXT = "<｜end▁of▁sentence｜>"

_INVOKE_HEAD_RE = re.compile(rf'<{DSML_TOKEN} invoke\s+name="([^"\n]+)"\s*>')
_PARAM_HEAD_RE = re.compile(rf'<{DSML_TOKEN} parameter\s+name="([^"\n]+)"(?:\s+string="(true|false)")?\s*>')
_WS = " \t\r\n"


# ---- events -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # 0-based position of the call in this completion (OpenAI `tool_calls[].index`)
    id: str  # `call_<24 hex>`
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgsDelta:
    index: int
    text: str  # the deltas of one call concatenate to a JSON object text


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ParsedCompletion:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def make_call_id(index: int, seed: str | None = None) -> str:
    """`call_` + 24 hex digits: random, or derived from (seed, index) so tests get stable ids."""
    if seed is None:
        return "call_" + secrets.token_hex(12)
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


# ---- rendering ----------------------------------------------------------------------------------------


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


# ---- parsing ------------------------------------------------------------------------------------------


def _held_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value(text: str) -> str | None:
    """`text` stripped when it is one strict JSON value (no NaN/Infinity), else None."""
    text = text.strip(_WS)
    try:
        json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return None
    return text


def _parse_invoke(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one complete `<｜DSML｜ invoke ...>...</｜DSML｜ invoke>`, None if malformed."""
    head = _INVOKE_HEAD_RE.match(text)
    if head is None:
        return None
    body = text[head.end() : len(text) - len(INVOKE_CLOSE)]
    members: dict[str, str] = {}
    pos = 0
    while True:
        while pos < len(body) and body[pos] in _WS:
            pos += 1
        if pos == len(body):
            break
        param = _PARAM_HEAD_RE.match(body, pos)
        if param is None:
            # A JSON object body (what grammar-constrained decoding may produce) is accepted in place of
            # parameter tags, but not mixed with them.
            if members or (obj := _json_value(body)) is None or not obj.startswith("{"):
                return None
            return head.group(1), obj
        end = body.find(PARAM_CLOSE, param.end())
        key, string_attr = param.group(1), param.group(2)
        if end < 0 or key in members:
            return None
        raw = body[param.end() : end]
        as_json = None if string_attr == "true" else _json_value(raw)
        # string="false" with a value that is not JSON (`True`, bare words) is kept as the string it is.
        members[key] = as_json if as_json is not None else json.dumps(raw, ensure_ascii=False)
        pos = end + len(PARAM_CLOSE)
    arguments = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in members.items()) + "}"
    return head.group(1), arguments


class _Mode(Enum):
    REASONING = "reasoning"  # before </think> (thinking mode only)
    CONTENT = "content"  # the answer; watches for the calls block when tools are enabled
    CALLS = "calls"  # inside <｜DSML｜ calls>
    AFTER_CALLS = "after_calls"  # after </｜DSML｜ calls>: whitespace is dropped, other text is content again
    RAW = "raw"  # after malformed markup: everything is content


class DsmlStreamParser:
    """Incremental parser for one completion's text. Not thread-safe; one instance per request.

    Args:
        thinking: the prompt ended in `<think>`, so output starts with reasoning up to `</think>`.
        tools_enabled: look for a calls block; when False, DSML text is plain content.
        id_seed: derive call ids from (seed, index) instead of randomly (tests).
    """

    def __init__(self, thinking: bool, tools_enabled: bool, *, id_seed: str | None = None) -> None:
        self._tools_enabled = tools_enabled
        self._id_seed = id_seed
        self._mode = _Mode.REASONING if thinking else _Mode.CONTENT
        self._eos_hold = ""  # a possible prefix of the EOS text, held before any mode sees it
        self._saw_eos = False
        self._finished = False
        self._buf = ""  # text the current mode holds (partial marker, unfinished invoke, whitespace)
        self._block_raw = ""  # separator + CALLS_OPEN until the first invoke parses (for the fallback)
        # While an invoke is open, new text is only appended to a list and checked for INVOKE_CLOSE
        # (with the tail of the text before it), so a long argument costs linear time, not quadratic.
        self._waiting = False
        self._pending: list[str] = []
        self._tail = ""
        self._num_calls = 0

    @property
    def num_tool_calls(self) -> int:
        return self._num_calls

    def feed(self, text_delta: str) -> list[Event]:
        """Consume the next piece of output text; returns the events it completes (maybe none)."""
        if self._finished:
            raise ValueError("feed() after finish()")
        if self._saw_eos or not text_delta:
            return []
        text = self._eos_hold + text_delta
        cut = text.find(EOS_TEXT)
        if cut >= 0:  # the model's end of turn: anything after it is not part of the answer
            text, self._eos_hold, self._saw_eos = text[:cut], "", True
        else:
            keep = _held_suffix(text, (EOS_TEXT,))
            text, self._eos_hold = text[: len(text) - keep], text[len(text) - keep :]
        out: list[Event] = []
        self._consume(text, out)
        return _coalesce(out)

    def finish(self) -> list[Event]:
        """End of output: releases held text; an unterminated calls block becomes content."""
        if self._finished:
            return []
        out: list[Event] = []
        self._consume(self._eos_hold, out)
        self._eos_hold = ""
        self._finished = True
        self._unwait()
        buf, self._buf = self._buf, ""
        if self._mode is _Mode.REASONING and buf:
            out.append(ReasoningDelta(buf))
        elif self._mode is _Mode.CONTENT and buf:
            out.append(ContentDelta(buf))
        elif self._mode is _Mode.CALLS and buf.strip(_WS):
            # An unterminated block whose invokes all closed (only whitespace left) is accepted as is.
            out.append(ContentDelta(self._block_raw + buf))
        return _coalesce(out)

    # ---- the mode machine -------------------------------------------------------------------------------

    def _consume(self, text: str, out: list[Event]) -> None:
        if self._waiting:
            window = self._tail + text
            if INVOKE_CLOSE not in window:
                self._pending.append(text)
                self._tail = window[-(len(INVOKE_CLOSE) - 1) :]
                return
            self._unwait()
        self._buf += text
        while self._step(out):
            pass

    def _unwait(self) -> None:
        self._buf += "".join(self._pending)
        self._pending.clear()
        self._waiting = False

    def _step(self, out: list[Event]) -> bool:
        """Make one transition on self._buf; True when the mode changed and the rest must be looked at."""
        buf = self._buf
        if self._mode is _Mode.REASONING:
            return self._scan_text(out, ReasoningDelta, (THINK_END,), _Mode.CONTENT)
        if self._mode is _Mode.CONTENT:
            if not self._tools_enabled:
                self._emit(out, ContentDelta, len(buf))
                return False
            return self._scan_text(out, ContentDelta, (CALLS_SEPARATOR + CALLS_OPEN, CALLS_OPEN), _Mode.CALLS)
        if self._mode is _Mode.CALLS:
            return self._step_calls(out)
        if self._mode is _Mode.AFTER_CALLS:
            if buf.strip(_WS):
                self._mode = _Mode.CONTENT
                return True
            return False
        self._emit(out, ContentDelta, len(buf))  # RAW
        return False

    def _emit(self, out: list[Event], kind: type, n: int) -> None:
        if n > 0:
            out.append(kind(self._buf[:n]))
            self._buf = self._buf[n:]

    def _scan_text(self, out: list[Event], kind: type, markers: tuple[str, ...], next_mode: _Mode) -> bool:
        """Emit text up to the first of `markers` and switch mode, or emit all but a possible partial marker."""
        buf = self._buf
        hits = [(buf.find(m), m) for m in markers]
        hits = [(i, m) for i, m in hits if i >= 0]
        if not hits:
            self._emit(out, kind, len(buf) - _held_suffix(buf, markers))
            return False
        at, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
        self._emit(out, kind, at)
        self._buf = self._buf[len(marker) :]
        if next_mode is _Mode.CALLS:
            self._block_raw = marker
        self._mode = next_mode
        return True

    def _step_calls(self, out: list[Event]) -> bool:
        buf = self._buf
        start = len(buf) - len(buf.lstrip(_WS)) if buf[:1] in _WS else 0
        if buf.startswith(CALLS_CLOSE, start):
            self._buf = buf[start + len(CALLS_CLOSE) :]
            self._mode = _Mode.AFTER_CALLS
            return True
        if buf.startswith(INVOKE_OPEN, start):
            end = buf.find(INVOKE_CLOSE, start)
            if end < 0:
                self._waiting, self._tail = True, buf[-(len(INVOKE_CLOSE) - 1) :]
                return False
            end += len(INVOKE_CLOSE)
            parsed = _parse_invoke(buf[start:end])
            if parsed is not None:
                index = self._num_calls
                self._num_calls += 1
                out.append(ToolCallStart(index, make_call_id(index, self._id_seed), parsed[0]))
                out.append(ToolCallArgsDelta(index, parsed[1]))
                out.append(ToolCallEnd(index))
                self._buf, self._block_raw = buf[end:], ""
                return True
        else:
            rest = buf[start:]
            if not rest or INVOKE_OPEN.startswith(rest) or CALLS_CLOSE.startswith(rest):
                return False  # a tag still arriving
        # Malformed: from the last point that parsed, the raw text is the answer.
        out.append(ContentDelta(self._block_raw + buf))
        self._buf, self._block_raw = "", ""
        self._mode = _Mode.RAW
        return False


def _coalesce(events: list[Event]) -> list[Event]:
    """Merge adjacent text deltas of the same kind."""
    merged: list[Event] = []
    for ev in events:
        if isinstance(ev, (ReasoningDelta, ContentDelta)):
            if not ev.text:
                continue
            if merged and type(merged[-1]) is type(ev):
                merged[-1] = type(ev)(merged[-1].text + ev.text)
                continue
        merged.append(ev)
    return merged


def parse_completion(text: str, thinking: bool, tools_enabled: bool, *, id_seed: str | None = None) -> ParsedCompletion:
    """Non-streaming parse of a whole completion: the same rules as feeding it to `DsmlStreamParser`."""
    parser = DsmlStreamParser(thinking, tools_enabled, id_seed=id_seed)
    events = parser.feed(text) + parser.finish()
    return collect_events(events)


def collect_events(events: Iterable[Event]) -> ParsedCompletion:
    """Fold a stream of events into reasoning, content and complete tool calls."""
    result = ParsedCompletion()
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for ev in events:
        if isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            calls[ev.index] = [ev.id, ev.name, ""]
        elif isinstance(ev, ToolCallArgsDelta):
            calls[ev.index][2] += ev.text
        elif isinstance(ev, ToolCallEnd):
            call_id, name, arguments = calls[ev.index]
            result.tool_calls.append(ToolCall(call_id, name, arguments))
    result.reasoning = "".join(reasoning)
    result.content = "".join(content)
    return result
