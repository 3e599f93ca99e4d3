"""A chat choice's output in Anthropic's terms: content blocks, stop reason, usage.

``ContentBlocks`` folds the DSML parser's events (dsml_events.py) into Messages content blocks and
returns, per event, the stream events that say so, so the streamed and the non-streamed answer are
the same fold::

    ReasoningDelta    -> a "thinking" block: thinking_delta ... signature_delta, then its stop
    ContentDelta      -> a "text" block: text_delta
    ToolCallStart     -> a "tool_use" block {id: "toolu_...", name, input: {}}
    ToolCallArgsDelta -> input_json_delta {partial_json}    (the fragments concatenate to the input)
    ToolCallEnd       -> content_block_stop

A call cut off by max_tokens has no ToolCallEnd: its block is stopped at the end like any other, the
stream has sent the input_json_delta of the arguments so far, and the Message's block has ``input: {}``
(those arguments are not a whole JSON object).

A block of another kind (or the end) stops the open one; block indexes are consecutive from 0.
Thinking blocks carry the constant signature ``SIGNATURE``: clients require a non-empty one and send
it back, and this server does not check it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from flashtier.server.openai.chat_choice import ChatChoiceState
from flashtier.server.text.dsml_events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

__all__ = ["SIGNATURE", "ContentBlocks", "StopInfo", "WireEvent", "messages_usage", "stop_info"]

SIGNATURE = "flashtier"

BlockKind = Literal["thinking", "text", "tool_use"]


@dataclass(frozen=True, slots=True)
class WireEvent:
    """One Messages stream event: its SSE ``event:`` name and its JSON data (whose ``type`` is the name)."""

    name: str
    data: dict[str, Any]


@dataclass(slots=True)
class _Block:
    kind: BlockKind
    pieces: list[str] = field(default_factory=list)  # thinking / text / input JSON fragments
    id: str = ""
    name: str = ""
    ended: bool = False  # tool_use: its ToolCallEnd came, so the pieces are a whole JSON object

    def opening(self) -> dict[str, Any]:
        """The block as content_block_start announces it: empty."""
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": ""}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": {}}

    def final(self) -> dict[str, Any]:
        text = "".join(self.pieces)
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": text, "signature": SIGNATURE}
        if self.kind == "text":
            return {"type": "text", "text": text}
        return {"type": "tool_use", "id": self.id, "name": self.name,
                "input": json.loads(text) if text and self.ended else {}}


def _tool_use_id(call_id: str) -> str:
    """``call_<hex>`` (the parser's) -> ``toolu_<hex>`` (Anthropic's prefix; the id is opaque either way)."""
    return "toolu_" + call_id.removeprefix("call_")


class ContentBlocks:
    """The content blocks of one answer, built from parser events; ``feed`` and ``close`` mutate it."""

    def __init__(self) -> None:
        self.blocks: list[_Block] = []
        self._open = False

    def feed(self, events: list[Event]) -> list[WireEvent]:
        """Fold `events` in; return the content_block_* stream events they make."""
        out: list[WireEvent] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                out += self._text("thinking", ev.text, {"type": "thinking_delta", "thinking": ev.text})
            elif isinstance(ev, ContentDelta):
                out += self._text("text", ev.text, {"type": "text_delta", "text": ev.text})
            elif isinstance(ev, ToolCallStart):
                out += self.close()
                out.append(self._start(_Block("tool_use", id=_tool_use_id(ev.id), name=ev.name)))
            elif isinstance(ev, ToolCallArgsDelta):
                if ev.text and self._open and self.blocks[-1].kind == "tool_use":
                    self.blocks[-1].pieces.append(ev.text)
                    out.append(self._delta({"type": "input_json_delta", "partial_json": ev.text}))
            elif isinstance(ev, ToolCallEnd):
                if self._open and self.blocks[-1].kind == "tool_use":
                    self.blocks[-1].ended = True
                out += self.close()
        return out

    def close(self) -> list[WireEvent]:
        """Stop the open block, if any (a thinking block gets its signature first)."""
        if not self._open:
            return []
        self._open = False
        index = len(self.blocks) - 1
        out = []
        if self.blocks[-1].kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        out.append(WireEvent("content_block_stop", {"type": "content_block_stop", "index": index}))
        return out

    def content(self) -> list[dict[str, Any]]:
        """The finished blocks, as a Message's ``content``."""
        return [b.final() for b in self.blocks]

    def _text(self, kind: BlockKind, text: str, delta: dict[str, Any]) -> list[WireEvent]:
        if not text:
            return []
        out = []
        if not (self._open and self.blocks[-1].kind == kind):
            out += self.close()
            out.append(self._start(_Block(kind)))
        self.blocks[-1].pieces.append(text)
        out.append(self._delta(delta))
        return out

    def _start(self, block: _Block) -> WireEvent:
        self.blocks.append(block)
        self._open = True
        return WireEvent("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                 "content_block": block.opening()})

    def _delta(self, delta: dict[str, Any]) -> WireEvent:
        return WireEvent("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                 "delta": delta})


@dataclass(frozen=True, slots=True)
class StopInfo:
    reason: str | None  # end_turn | max_tokens | stop_sequence | tool_use; None while unfinished or aborted
    sequence: str | None  # the stop sequence matched (stop_reason "stop_sequence" only)


def stop_info(choice: ChatChoiceState) -> StopInfo:
    """Anthropic's stop_reason for a choice: a completed tool call wins over a stop sequence (as in chat)."""
    reason = choice.text.finish_reason
    if reason == "length":
        return StopInfo("max_tokens", None)
    if reason != "stop":
        return StopInfo(None, None)
    if choice.answer.has_tool_calls:
        return StopInfo("tool_use", None)
    matched = choice.text.stop_reason
    if isinstance(matched, str):
        return StopInfo("stop_sequence", matched)
    return StopInfo("end_turn", None)


def messages_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage from the OpenAI-style ``Generation.usage()``: input_tokens excludes cache reads."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "flashtier": usage.get("flashtier")}
