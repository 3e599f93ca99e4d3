"""The Engram token normalisation map: token id -> compressed class id (model.md §3.7).

Each token's text (``decode([id])``) is normalised: NFKC, NFD, strip accents (drop combining marks),
lowercase, collapse whitespace runs to one space, strip. Tokens that do not decode to complete UTF-8
(byte-level BPE fragments) are keyed by their raw vocabulary string instead, so they never merge with
each other. Classes are numbered in order of first appearance by token id (assumption: the official
code's numbering is not public; any fixed numbering is equivalent for a model trained with it, so
this matters only for real checkpoints — see docs/model.md).

The map is text processing, so it lives here; the engine receives the finished int tensor.
"""

from __future__ import annotations

import re
import unicodedata

import torch

from .tokenizer import Tokenizer

_WS = re.compile(r"\s+")


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    text = unicodedata.normalize("NFD", text)
    text = "".join(c for c in text if not unicodedata.combining(c))
    return _WS.sub(" ", text.lower()).strip()


def engram_token_map(
    tokenizer: Tokenizer, vocab_size: int | None = None, n_classes: int | None = None
) -> tuple[torch.Tensor, int]:
    """(map [vocab_size] int64, number of distinct normalised keys).

    Ids beyond the tokenizer's vocabulary get class 0. With ``n_classes`` (the checkpoint's
    ``engram_compressed_vocab``), class ids are folded modulo it: the shipped V4 tokenizer yields
    99,738 keys where the V4.1 config asserts 99,092, and the hash multipliers are sized for the
    latter (a larger id could overflow int64 in the n-gram hash).
    """
    n = vocab_size or tokenizer.vocab_size
    classes: dict[str, int] = {}
    out = torch.zeros(n, dtype=torch.long)
    for tid in range(min(n, tokenizer.vocab_size)):
        text = tokenizer.decode([tid])
        key = "\x00raw:" + tokenizer.id_to_token(tid) if "\ufffd" in text else normalise(text)
        out[tid] = classes.setdefault(key, len(classes))
    if n_classes is not None:
        out = out % n_classes
    return out, len(classes)
