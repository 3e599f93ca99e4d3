"""Per-token text and exact UTF-8 bytes, for logprobs: ``TokenTexts``."""

from __future__ import annotations

from flashtier.server.text.tokenizer import Tokenizer

__all__ = ["TokenTexts"]


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes stand for themselves, the other 68
    bytes for the code points from 256 upward, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


class TokenTexts:
    """Per-token text and exact UTF-8 bytes, for logprobs (cached)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._decoder = _byte_level_decoder()
        self._special = tokenizer.special_ids
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = self._tok.decode([token_id])
        if token_id in self._special:
            raw = list(text.encode("utf-8"))
        else:
            piece = self._tok.id_to_token(token_id)
            try:
                raw = [self._decoder[ch] for ch in piece]
            except KeyError:
                raw = list(text.encode("utf-8", errors="replace"))
        if len(self._cache) < 200_000:
            self._cache[token_id] = (text, raw)
        return text, raw
