"""The text of one choice: ``ChoiceText`` turns its token deltas into text, with incremental
detokenization and stop strings (found in the detokenized text, the text truncated before them; text
that may be the start of a stop string is held back until the next delta decides it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from flashtier.engine.core.outputs import ChoiceDelta, TokenLogprob
from flashtier.server.text.held_suffix import held_suffix
from flashtier.server.text.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["ChoiceText", "StopMatcher", "TextStep"]


class StopMatcher:
    """Finds the first stop string in a text arriving in pieces; holds back possible partial matches."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop
        self._held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string matched or None). After a match, stop pushing."""
        if not self._stops:
            return text, None
        buf = self._held + text
        hit: tuple[int, str] | None = None
        for stop in self._stops:
            at = buf.find(stop)
            if at >= 0 and (hit is None or at < hit[0]):
                hit = (at, stop)
        if hit is not None:
            at, stop = hit
            self._held = ""
            return buf[:at] + (stop if self._include else ""), stop
        keep = held_suffix(buf, self._stops)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


@dataclass(slots=True)
class TextStep:
    """What one ChoiceDelta added to a choice."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # engine level: stop | length | abort
    stop_reason: int | str | None = None  # the stop string or stop token id (None for EOS)


class ChoiceText:
    """Detokenizes one choice and applies its stop strings; ``add`` once per ChoiceDelta."""

    def __init__(self, tokenizer: Tokenizer, *, stops: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = False, eos_token_id: int | None = None) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop = StopMatcher(stops, include_stop)
        self._eos = eos_token_id
        self.num_tokens = 0
        self.token_ids: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, delta: ChoiceDelta) -> TextStep:
        step = TextStep()
        if self.finished:
            return step
        lps = delta.logprobs or ()
        for k, tok in enumerate(delta.token_ids):
            piece = self._detok.add_token(tok)
            self.num_tokens += 1
            self.token_ids.append(tok)
            step.token_ids.append(tok)
            if k < len(lps):
                step.logprobs.append(lps[k])
            emit, hit = self._stop.push(piece)
            step.text += emit
            if hit is not None:
                self._finish(step, "stop", hit)
                return step
        if delta.finish_reason is not None:
            emit, hit = self._stop.push(self._detok.flush())
            step.text += emit
            if hit is not None:
                self._finish(step, "stop", hit)
                return step
            step.text += self._stop.flush()
            stop_id = delta.stop_token_id if delta.stop_token_id != self._eos else None
            self._finish(step, delta.finish_reason, stop_id)
        return step

    def abort(self) -> TextStep:
        """The request ended without this choice finishing (client gone, engine stopped)."""
        step = TextStep()
        if not self.finished:
            step.text = self._stop.push(self._detok.flush())[0] + self._stop.flush()
            self._finish(step, "abort", None)
        return step

    def _finish(self, step: TextStep, reason: str, stop_reason: int | str | None) -> None:
        self.finished = True
        self.finish_reason = step.finish_reason = reason
        self.stop_reason = step.stop_reason = stop_reason
