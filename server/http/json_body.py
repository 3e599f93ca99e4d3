"""``parse_json_body``: ``json.loads`` of a request body without holding the GIL for long.

``json.loads`` is one C call that holds the GIL to its end: 150 ms for a 20 MB prompt (measured), and
running it on a worker thread does not help, because the event loop needs the GIL too. Almost all of a
large body is a few long string literals (prompts, messages), so this parses it in short steps instead:

1. find every string literal (``bytes.find`` from quote to quote, a Python loop between C calls), and
   between them every array of numbers (token ids) longer than ``LONG_LITERAL`` bytes;
2. ``json.loads`` the body with each long literal or array swapped for a placeholder string;
3. decode each long literal in ~``PIECE`` byte pieces, cut only where no escape sequence, surrogate pair
   or UTF-8 character spans the cut (an array: at commas), and put the result where its placeholder is.

The result equals ``json.loads(body)`` (every byte still goes through ``json.loads``), or ``ValueError``
is raised where ``json.loads`` would raise (a caller may then let ``json.loads`` report the error).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

__all__ = ["LONG_LITERAL", "PIECE", "parse_json_body"]

LONG_LITERAL = 64 << 10  # string literals longer than this (bytes) are decoded in pieces
PIECE = 1 << 20  # bytes per json.loads call when decoding a long literal: a few ms of GIL
_QUOTE, _BACKSLASH = 0x22, 0x5C
_NUMBER_BYTES = b"0123456789-+.eE, \t\r\n"


def _string_end(body: bytes, start: int) -> int:
    """Index of the quote closing the literal whose text starts at `start`; ValueError if none."""
    pos = start
    while True:
        end = body.find(b'"', pos)
        if end < 0:
            raise ValueError("unterminated string")
        k = end
        while k > start and body[k - 1] == _BACKSLASH:
            k -= 1
        if (end - k) % 2 == 0:  # an even run of backslashes escapes itself, not the quote
            return end
        pos = end + 1


def _escape_start(body: bytes, at: int, start: int) -> bool:
    """Whether ``body[at]`` is a backslash that begins an escape (an even run of backslashes before it)."""
    if body[at] != _BACKSLASH:
        return False
    k = at
    while k > start and body[k - 1] == _BACKSLASH:
        k -= 1
    return (at - k) % 2 == 0


def _safe_cut(body: bytes, p: int, start: int, end: int) -> int:
    """The first position >= `p` inside the literal [start, end) where it may be cut: not inside an escape
    (``\\n``, ``\\uXXXX``), not before a low-surrogate escape (it may pair with the one before), not inside
    a UTF-8 character. `end` when there is none."""
    while p < end:
        if 0x80 <= body[p] < 0xC0:  # a UTF-8 continuation byte
            p += 1
            continue
        covered = any(j >= start and _escape_start(body, j, start) and (d == 1 or body[j + 1] == ord("u"))
                      for d, j in ((d, p - d) for d in range(1, 6)))
        if covered:
            p += 1
            continue
        if _escape_start(body, p, start) and body[p + 1:p + 3].lower() == b"ud" and body[p + 3:p + 4] in b"cdefCDEF":
            p += 1
            continue
        return p
    return end


def _decode_literal(body: bytes, start: int, end: int) -> str:
    """The text of the literal body[start:end] (without its quotes), decoded piece by piece."""
    pieces, pos = [], start
    while pos < end:
        cut = _safe_cut(body, min(pos + PIECE, end), start, end)
        pieces.append(json.loads(b'"' + body[pos:cut] + b'"'))
        pos = cut
    return "".join(pieces)


def _decode_numbers(body: bytes, start: int, end: int) -> list[Any]:
    """The items of the number array whose text (without brackets) is body[start:end], piece by piece."""
    items: list[Any] = []
    pos = start
    while pos < end:
        cut = body.find(b",", min(pos + PIECE, end), end)
        cut = end if cut < 0 else cut
        items += json.loads(b"[" + body[pos:cut] + b"]")
        pos = cut + 1
        if pos == end:  # a trailing comma: as invalid as json.loads finds it
            raise ValueError("trailing comma in an array")
    return items


def _number_arrays(body: bytes, start: int, end: int) -> list[tuple[int, int]]:
    """Spans (with brackets) of the arrays of numbers in body[start:end] (no strings there) whose text is
    longer than LONG_LITERAL."""
    spans, pos = [], start
    while (open_at := body.find(b"[", pos, end)) >= 0:
        close = body.find(b"]", open_at, end)
        if close < 0:
            break
        if close - open_at > LONG_LITERAL and not body[open_at + 1:close].translate(None, _NUMBER_BYTES):
            spans.append((open_at, close + 1))
            pos = close + 1
        else:
            pos = open_at + 1
    return spans


def _replace(tree: Any, texts: dict[str, Any]) -> Any:
    """`tree` with every placeholder string (value or key) replaced by its text; iterative (no recursion
    limit), in place for containers."""
    if isinstance(tree, str):
        return texts.get(tree, tree)
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(key in texts for key in node):
                items = [(texts.get(k, k), v) for k, v in node.items()]
                node.clear()
                node.update(items)
            for key, value in node.items():
                if isinstance(value, str):
                    if value in texts:
                        node[key] = texts[value]
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                if isinstance(value, str):
                    if value in texts:
                        node[i] = texts[value]
                elif isinstance(value, (dict, list)):
                    stack.append(value)
    return tree


def parse_json_body(body: bytes) -> Any:
    """``json.loads(body)`` in short GIL holds (module doc); ValueError where ``json.loads`` fails."""
    spans: list[tuple[int, int, bool]] = []  # (start, end, is_string): a literal without its quotes
    pos = 0
    while True:
        quote = body.find(b'"', pos)
        gap_end = len(body) if quote < 0 else quote
        if gap_end - pos > LONG_LITERAL:
            spans += [(start, end, False) for start, end in _number_arrays(body, pos, gap_end)]
        if quote < 0:
            break
        end = _string_end(body, quote + 1)
        if end - quote - 1 > LONG_LITERAL:
            spans.append((quote + 1, end, True))
        pos = end + 1
    if not spans:
        return json.loads(body)
    nonce = secrets.token_hex(8)
    marks = [f"\x00flashtier-{nonce}-{i}" for i in range(len(spans))]
    parts, pos = [], 0
    for mark, (start, end, is_string) in zip(marks, spans, strict=True):
        text = json.dumps(mark).encode("ascii")
        parts += [body[pos:start], text[1:-1] if is_string else text]
        pos = end
    parts.append(body[pos:])
    tree = json.loads(b"".join(parts))
    values = {mark: _decode_literal(body, start, end) if is_string else _decode_numbers(body, start + 1, end - 1)
              for mark, (start, end, is_string) in zip(marks, spans, strict=True)}
    return _replace(tree, values)
