"""One choice of a text completion: its ``ChoiceText``, the text collected so far, and the legacy
completions logprobs (parallel lists of tokens, logprobs, top alternatives and text offsets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashtier.server.text.choice_text import ChoiceText, TextStep
from flashtier.server.serving.state import clamp_logprob
from flashtier.server.text.token_texts import TokenTexts

__all__ = ["CompletionChoiceState"]


@dataclass
class CompletionChoiceState:
    index: int
    text: ChoiceText
    pieces: list[str] = field(default_factory=list)
    offset: int = 0  # characters of text so far (echo included), for text_offset
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    reasoning_tokens: int = 0  # a raw completion has no reasoning part

    def logprobs_of(self, texts: TokenTexts, step: TextStep, k: int) -> dict[str, Any]:
        """Logprob lists for the step's tokens (appended to the choice's totals as well)."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in step.logprobs:
            text, _ = texts.get(lp.token_id)
            top = {texts.get(t)[0]: clamp_logprob(v) for t, v in lp.top[:k]}
            out["tokens"].append(text)
            out["token_logprobs"].append(clamp_logprob(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        self.tokens += out["tokens"]
        self.token_logprobs += out["token_logprobs"]
        self.top_logprobs += out["top_logprobs"]
        self.text_offset += out["text_offset"]
        return out

    def logprobs_dict(self) -> dict[str, Any]:
        """The choice's logprobs so far, in the answer's shape."""
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
