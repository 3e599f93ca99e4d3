"""Parser events -> Responses output items, and the stream events that build them.

``OutputBuilder`` folds one choice's events (dsml_events.py) into items, in the order the model wrote
them; both renderers of responses/stream.py use it, so the streamed items and the JSON body agree::

    ReasoningDelta    -> a reasoning item   {type: reasoning, id: rs_..., summary: [], content: [reasoning_text]}
    ContentDelta      -> a message item     {type: message, id: msg_..., role: assistant, content: [output_text]}
    ToolCallStart/Args/End -> a function_call item {type: function_call, id: fc_..., call_id, name, arguments}

An item opens with ``response.output_item.added`` (and, for text, ``response.content_part.added``), grows
by deltas (``response.reasoning_text.delta`` / ``response.output_text.delta`` /
``response.function_call_arguments.delta``) and closes with the matching ``.done`` events and
``response.output_item.done`` when an item of another kind starts or the output ends. Events are plain
dicts without ``sequence_number`` (the stream numbers them). A call cut off by max_output_tokens (no
ToolCallEnd) is closed by ``finish("incomplete")``: its item has ``status: incomplete`` and the arguments
so far (possibly incomplete JSON).

Item ids are ``<prefix>_<hex of the response id>_<n>``, so an ``item_reference`` to an output item
names the stored response to look in (``response_id_of_item``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flashtier.server.text.dsml_events import ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallStart
from flashtier.server.responses.protocol import encode_reasoning

__all__ = ["OutputBuilder", "response_id_of_item"]

_ITEM_ID = re.compile(r"^(?:rs|msg|fc)_([0-9a-f]{32})_[0-9]+$")


def response_id_of_item(item_id: str) -> str | None:
    """The id of the response whose output holds the item `item_id` (None: not an id this server made)."""
    m = _ITEM_ID.match(item_id)
    return f"resp_{m.group(1)}" if m else None


@dataclass
class _Open:
    kind: str  # reasoning | message | function_call
    index: int  # output_index
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)


class OutputBuilder:
    """Output items of one choice. Mutates only itself; ``items`` holds the closed items in order."""

    def __init__(self, response_id: str, *, encrypted_reasoning: bool = False) -> None:
        self._hex = response_id.removeprefix("resp_")
        self._encrypted = encrypted_reasoning
        self.items: list[dict[str, Any]] = []
        self._open: _Open | None = None
        self._made_answer = False  # a message or a call was opened

    def add(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        """Fold parser events in; returns the stream events they make."""
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                self._text(out, "reasoning", ev.text)
            elif isinstance(ev, ContentDelta):
                self._text(out, "message", ev.text)
            elif isinstance(ev, ToolCallStart):
                self._close(out, "completed")
                self._start(out, "function_call", {"type": "function_call", "call_id": ev.id, "name": ev.name,
                                                   "arguments": ""})
            elif isinstance(ev, ToolCallArgsDelta) and self._open is not None:
                self._open.text.append(ev.text)
                out.append(self._ev("response.function_call_arguments.delta", delta=ev.text))
            else:  # ToolCallEnd: the call's arguments are complete
                self._close(out, "completed")
        return out

    def finish(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the open item with item status `status` (completed | incomplete); a completed output
        without any answer gets an empty message, so a client always finds one. Returns the events."""
        out: list[dict[str, Any]] = []
        if not self._made_answer and status == "completed":
            self._text(out, "message", "")
        self._close(out, status)
        return out

    # ---- item life cycle ---------------------------------------------------------------------------------

    def _text(self, out: list[dict[str, Any]], kind: str, text: str) -> None:
        if self._open is None or self._open.kind != kind:
            self._close(out, "completed")
            if kind == "reasoning":
                self._start(out, kind, {"type": "reasoning", "summary": [], "content": []})
                part = {"type": "reasoning_text", "text": ""}
            else:
                self._start(out, kind, {"type": "message", "role": "assistant", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._ev("response.content_part.added", content_index=0, part=part))
        if not text:
            return
        self._open.text.append(text)  # type: ignore[union-attr]
        if kind == "reasoning":
            out.append(self._ev("response.reasoning_text.delta", content_index=0, delta=text))
        else:
            out.append(self._ev("response.output_text.delta", content_index=0, delta=text, logprobs=[]))

    def _start(self, out: list[dict[str, Any]], kind: str, item: dict[str, Any]) -> None:
        index = len(self.items)
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = {"id": f"{prefix}_{self._hex}_{index}", **item}
        if kind != "reasoning":
            self._made_answer = True
            item["status"] = "in_progress"
        self._open = _Open(kind, index, item)
        out.append({"type": "response.output_item.added", "output_index": index, "item": dict(item)})

    def _close(self, out: list[dict[str, Any]], status: str) -> None:
        op, self._open = self._open, None
        if op is None:
            return
        text, item = "".join(op.text), op.item
        if op.kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(self._ev("response.reasoning_text.done", op, content_index=0, text=text))
            out.append(self._ev("response.content_part.done", op, content_index=0, part=part))
            item["content"] = [part]
            if self._encrypted:
                item["encrypted_content"] = encode_reasoning(text)
        elif op.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._ev("response.output_text.done", op, content_index=0, text=text, logprobs=[]))
            out.append(self._ev("response.content_part.done", op, content_index=0, part=part))
            item["content"], item["status"] = [part], status
        else:
            item["arguments"], item["status"] = text, status
            out.append(self._ev("response.function_call_arguments.done", op, arguments=text, name=item["name"]))
        self.items.append(item)
        out.append({"type": "response.output_item.done", "output_index": op.index, "item": item})

    def _ev(self, kind: str, op: _Open | None = None, **fields: Any) -> dict[str, Any]:
        op = op or self._open
        assert op is not None
        return {"type": kind, "item_id": op.item["id"], "output_index": op.index, **fields}
