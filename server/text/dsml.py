"""DSML out of model output: `DsmlStreamParser` splits a completion's text into reasoning, content and
tool calls (the markup itself, and how it is written, is in dsml_markup.py; the events in dsml_events.py).

An assistant turn as the model writes it (thinking mode; without thinking the `...</think>` part is absent
because the prompt already ends in `</think>`):

    {reasoning}</think>{content}\\n\\n<｜DSML｜ calls>...</｜DSML｜ calls><｜end▁of▁sentence｜>

Streaming contract. `DsmlStreamParser.feed` accepts the output text split at any character boundary and
returns typed events; text that might be the start of a marker (`</thi`, `\\n\\n<｜DS`, the EOS text) is held
back until the next delta decides it. Concatenating the events of any chunking gives the same result as
`parse_completion` on the whole text. A tool call's events (start, arguments, end) are emitted together
once its `</｜DSML｜ invoke>` arrives: the arguments are only known to be well formed then, and an event
already sent cannot be taken back. Malformed or unterminated markup never raises: from the first point
that does not parse, the raw text is emitted as content.

Output that was cut off (``finish(cut=True)``: max_tokens, or the request ended) never shows markup.
Held text that may be the start of a marker is dropped, and so is a calls block whose invoke has no
complete name yet. An invoke whose name is complete becomes a call: `ToolCallStart` and
`ToolCallArgsDelta` with the arguments so far (`parse_invoke_prefix`: a possibly incomplete JSON text)
and no `ToolCallEnd`; a call without its end is one that was cut off.
"""

from __future__ import annotations

from enum import Enum

from flashtier.server.text.dsml_events import (
    ContentDelta,
    Event,
    ParsedCompletion,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
    collect_events,
    make_call_id,
)
from flashtier.server.text.dsml_markup import (
    CALLS_CLOSE,
    CALLS_OPEN,
    CALLS_SEPARATOR,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    WHITESPACE,
    parse_invoke,
    parse_invoke_prefix,
)
from flashtier.server.text.held_suffix import held_suffix
from flashtier.server.text.tokenizer import EOS_TEXT, THINK_END

__all__ = ["DsmlStreamParser", "parse_completion"]


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
            keep = held_suffix(text, (EOS_TEXT,))
            text, self._eos_hold = text[: len(text) - keep], text[len(text) - keep :]
        out: list[Event] = []
        self._consume(text, out)
        return coalesce(out)

    def finish(self, *, cut: bool = False) -> list[Event]:
        """End of output; returns the last events. Ends the parser (a later `feed` raises ValueError).

        The model ended its output (`cut` False): held text is released and an unterminated calls block
        becomes content. The output was cut off (`cut` True: max_tokens, an aborted request): held text
        that may start a marker is dropped, an invoke with a complete name becomes a call without its
        `ToolCallEnd` (the arguments so far), and the rest of an open calls block is dropped.
        """
        if self._finished:
            return []
        out: list[Event] = []
        self._consume(self._eos_hold, out)
        self._eos_hold = ""
        self._finished = True
        self._unwait()
        buf, self._buf = self._buf, ""
        if cut:
            self._finish_cut(buf, out)
        elif self._mode is _Mode.REASONING and buf:
            out.append(ReasoningDelta(buf))
        elif self._mode is _Mode.CONTENT and buf:
            out.append(ContentDelta(buf))
        elif self._mode is _Mode.CALLS and buf.strip(WHITESPACE):
            # An unterminated block whose invokes all closed (only whitespace left) is accepted as is.
            out.append(ContentDelta(self._block_raw + buf))
        return coalesce(out)

    def _finish_cut(self, buf: str, out: list[Event]) -> None:
        """`finish(cut=True)` on what the current mode still holds (`buf`); appends the events to `out`."""
        if self._mode is not _Mode.CALLS:
            return  # reasoning / content: only a possible marker start is held; after calls: whitespace
        rest = buf.lstrip(WHITESPACE)
        if not rest.startswith(INVOKE_OPEN):
            return  # a tag still arriving (anything else already went raw in _step_calls)
        partial = parse_invoke_prefix(rest)
        if partial is None:
            return  # the name is not complete: no call
        index = self._num_calls
        self._num_calls += 1
        out.append(ToolCallStart(index, make_call_id(index, self._id_seed), partial.name))
        out.append(ToolCallArgsDelta(index, partial.arguments))

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
            if buf.strip(WHITESPACE):
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
            self._emit(out, kind, len(buf) - held_suffix(buf, markers))
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
        start = len(buf) - len(buf.lstrip(WHITESPACE)) if buf[:1] in WHITESPACE else 0
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
            parsed = parse_invoke(buf[start:end])
            if parsed is not None:
                index = self._num_calls
                self._num_calls += 1
                out.append(ToolCallStart(index, make_call_id(index, self._id_seed), parsed.name))
                out.append(ToolCallArgsDelta(index, parsed.arguments))
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


def parse_completion(text: str, thinking: bool, tools_enabled: bool, *, id_seed: str | None = None,
                     cut: bool = False) -> ParsedCompletion:
    """Non-streaming parse of a whole completion: the same rules as feeding it to `DsmlStreamParser`
    (`cut`: the output was cut off, as `DsmlStreamParser.finish`)."""
    parser = DsmlStreamParser(thinking, tools_enabled, id_seed=id_seed)
    events = parser.feed(text) + parser.finish(cut=cut)
    return collect_events(events)
