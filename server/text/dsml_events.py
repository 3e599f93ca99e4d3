"""What the DSML stream parser emits: typed events, and complete tool calls folded from them.

A completion's text becomes `ReasoningDelta` / `ContentDelta` pieces and, per tool call, `ToolCallStart`,
`ToolCallArgsDelta` (the arguments JSON text) and `ToolCallEnd`. A call whose `ToolCallEnd` never comes
was cut off (max_tokens): its arguments are the text written so far, possibly incomplete JSON.
`collect_events` folds any sequence of them into a `ParsedCompletion`.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CompletionBuilder",
    "ContentDelta",
    "Event",
    "ParsedCompletion",
    "ReasoningDelta",
    "ToolCall",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "coalesce",
    "collect_events",
    "make_call_id",
]


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
    arguments: str  # JSON object text; when not `complete`, the start of one
    complete: bool = True  # False: the output was cut off inside this call

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


def coalesce(events: list[Event]) -> list[Event]:
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


@dataclass(slots=True)
class _OpenCall:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    ended: bool = False


class CompletionBuilder:
    """Folds events, as they come, into reasoning, content and tool calls (those that never ended, cut
    off, with ``complete`` False). ``add`` mutates the builder; ``build`` does not."""

    def __init__(self) -> None:
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: dict[int, _OpenCall] = {}

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    def add(self, ev: Event) -> None:
        if isinstance(ev, ReasoningDelta):
            self._reasoning.append(ev.text)
        elif isinstance(ev, ContentDelta):
            self._content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            self._calls[ev.index] = _OpenCall(ev.id, ev.name)
        elif isinstance(ev, ToolCallArgsDelta):
            self._calls[ev.index].arguments.append(ev.text)
        elif isinstance(ev, ToolCallEnd):
            self._calls[ev.index].ended = True

    def build(self) -> ParsedCompletion:
        calls = [ToolCall(c.id, c.name, "".join(c.arguments), c.ended) for _, c in sorted(self._calls.items())]
        return ParsedCompletion("".join(self._reasoning), "".join(self._content), calls)


def collect_events(events: Iterable[Event]) -> ParsedCompletion:
    """Fold a stream of events into reasoning, content and tool calls (cut-off ones not `complete`)."""
    builder = CompletionBuilder()
    for ev in events:
        builder.add(ev)
    return builder.build()
