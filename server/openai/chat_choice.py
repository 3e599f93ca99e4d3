"""One choice of a chat completion: its text (``ChoiceText``), then ``DsmlStreamParser``, whose events
both renderers of openai/chat_route.py turn into OpenAI fields; the events are also folded into the whole
answer, and the reasoning tokens counted for ``usage``.

A choice that ends by "length" or "abort" was cut off: the parser is finished with ``cut=True``, so no
markup reaches a client and a call cut off after its name is a call with the arguments so far (no
``ToolCallEnd``; dsml.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashtier.server.text.choice_text import ChoiceText, TextStep
from flashtier.server.text.dsml import DsmlStreamParser
from flashtier.server.text.dsml_events import CompletionBuilder, Event

__all__ = ["CUT_REASONS", "ChatChoiceState"]

CUT_REASONS = ("length", "abort")  # engine finish reasons that stop the output before the model ended it


@dataclass
class ChatChoiceState:
    """Text, parser and accounting of one choice."""

    index: int
    text: ChoiceText
    parser: DsmlStreamParser
    parallel_tool_calls: bool
    think_end_id: int | None
    in_reasoning: bool
    reasoning_tokens: int = 0
    answer: CompletionBuilder = field(default_factory=CompletionBuilder)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def step(self, step: TextStep) -> list[Event]:
        """Parser events for a TextStep (already applied to self.text); folds them into ``answer`` and
        counts reasoning tokens (mutates both and the parser)."""
        for tok in step.token_ids:
            if self.in_reasoning:
                if tok == self.think_end_id:
                    self.in_reasoning = False
                else:
                    self.reasoning_tokens += 1
        events = self.parser.feed(step.text) if step.text else []
        if step.finish_reason is not None:
            events += self.parser.finish(cut=step.finish_reason in CUT_REASONS)
        kept: list[Event] = []
        for ev in events:
            index = getattr(ev, "index", None)
            if index is not None and not self.parallel_tool_calls and index > 0:
                continue  # parallel_tool_calls=false: only the first call
            kept.append(ev)
            self.answer.add(ev)
        return kept

    def abort(self) -> list[Event]:
        """The request ended without this choice finishing: release held text, end it with "abort"."""
        return self.step(self.text.abort())

    @property
    def finish_reason(self) -> str | None:
        reason = self.text.finish_reason
        return "tool_calls" if reason == "stop" and self.answer.has_tool_calls else reason
