"""The Engram token map: token id -> compressed class id (model.md §3.7), as the checkpoint was trained.

The rules are the published ones (``build_compressed_token_map`` in the official V4.1
``inference/engram.py``), applied to every id of the tokenizer in id order:

    text = decode([id])                  (the raw backend decode: special tokens kept, no clean-up)
    if "\ufffd" in text:  key = the token's vocabulary string   (a partial UTF-8 byte token, unprefixed)
    else:                 key = normalise(text), or text itself when that is empty
    class = order of the key's first appearance

``normalise`` is the official normaliser chain, run by the same ``tokenizers`` library the tokenizer
uses: NFKC, NFD, strip accents (every mark: Mn, Mc and Me), lowercase (per character), replace each run
of ``[ \\t\\r\\n]`` by one space, turn a text that is exactly one space into a sentinel so the strip
keeps it, strip (all Unicode whitespace), sentinel back to a space. So "\\n\\n" and " " share the class
" ", while "\\x0c" (stripped to nothing) keeps its own text as key. On the shipped tokenizer this gives
99,092 classes, the V4.1 config's ``engram_compressed_vocab``, and the hash multipliers are sized for
exactly that count: a tokenizer with another count is refused, as the official code asserts.

The map is text processing, so it lives here; the engine receives the finished int tensor.
``model_token_map`` sizes it to a model's config, ``install_token_map`` sets it on a loaded model:
every entry point (``flashtier serve``/``generate``, the offline ``LLM``) goes through these two.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from tokenizers import Regex, normalizers

from flashtier.server.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from flashtier.engine.model.config import ModelConfig
    from flashtier.engine.model.transformer import Transformer

__all__ = ["engram_token_map", "install_token_map", "model_token_map", "normalise"]

# A private-use character: a text that is exactly one space survives Strip() as this, then turns back.
_SENTINEL = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"


@lru_cache(maxsize=1)
def _normaliser() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def normalise(text: str) -> str:
    """The published normaliser chain on ``text`` (may return "": the caller then keys on the text)."""
    return _normaliser().normalize_str(text)


def engram_token_map(
    tokenizer: Tokenizer, vocab_size: int | None = None, n_classes: int | None = None
) -> tuple[torch.Tensor, int]:
    """(map [vocab_size] int64, number of classes over the whole tokenizer).

    Classes are counted over every id of ``tokenizer`` (as the official code does) and the map is then
    cut or padded to ``vocab_size`` (default: the tokenizer's); ids beyond the tokenizer get class 0.
    ``n_classes`` (the checkpoint's ``engram_compressed_vocab``) is checked: a different class count
    raises ValueError, since every n-gram hash multiplier is derived from it. Mutates nothing.
    """
    n_tok = tokenizer.vocab_size
    classes: dict[str, int] = {}
    full = []
    for tid in range(n_tok):
        text = tokenizer.decode([tid])
        key = tokenizer.id_to_token(tid) if _REPLACEMENT_CHAR in text else (normalise(text) or text)
        full.append(classes.setdefault(key, len(classes)))
    if n_classes is not None and len(classes) != n_classes:
        raise ValueError(
            f"n_classes: the tokenizer {tokenizer.path} gives {len(classes)} Engram classes but the model's "
            f"engram_compressed_vocab is {n_classes}; use the tokenizer the checkpoint was trained with"
        )
    n = vocab_size or n_tok
    out = torch.zeros(n, dtype=torch.long)
    m = min(n, n_tok)
    out[:m] = torch.tensor(full[:m], dtype=torch.long)
    return out, len(classes)


def model_token_map(tokenizer: Tokenizer, cfg: ModelConfig) -> torch.Tensor:
    """The map a model of config `cfg` takes: one entry per vocabulary id (on the CPU).

    Raises ValueError when the tokenizer's class count is not ``cfg.engram_compressed_vocab``."""
    token_map, _ = engram_token_map(tokenizer, cfg.vocab_size, cfg.engram_compressed_vocab)
    return token_map


def install_token_map(model: Transformer, tokenizer: Tokenizer) -> None:
    """Set `tokenizer`'s map on a loaded model (on the model's device); raises as ``model_token_map``."""
    model.set_token_map(model_token_map(tokenizer, model.cfg).to(model.device))
