"""The Engram token normalisation map: token id -> compressed class id (model.md §3.7).

Each token's text (``decode([id])``) is normalised: NFKC, NFD, strip accents (drop combining marks),
lowercase, collapse whitespace runs to one space, strip. Tokens that do not decode to complete UTF-8
(byte-level BPE fragments) are keyed by their raw vocabulary string instead, so they never merge with
each other. Classes are numbered in order of first appearance by token id (assumption: the official
code's numbering is not public; any fixed numbering is equivalent for a model trained with it, so
this matters only for real checkpoints — see docs/model.md).

The map is text processing, so it lives here; the engine receives the finished int tensor.
``model_token_map`` sizes it to a model's config, ``install_token_map`` sets it on a loaded model:
every entry point (``flashtier serve``/``generate``, the offline ``LLM``) goes through these two.
"""

from __future__ import annotations

import re
import unicodedata
from typing import TYPE_CHECKING

import torch

from flashtier.server.tokenizer import Tokenizer

if TYPE_CHECKING:
    from flashtier.engine.model.config import ModelConfig
    from flashtier.engine.model.transformer import Transformer

__all__ = ["engram_token_map", "install_token_map", "model_token_map", "normalise"]

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


def model_token_map(tokenizer: Tokenizer, cfg: ModelConfig) -> torch.Tensor:
    """The map a model of config `cfg` takes: one entry per vocabulary id, classes folded to
    ``cfg.engram_compressed_vocab`` (on the CPU)."""
    token_map, _ = engram_token_map(tokenizer, cfg.vocab_size, cfg.engram_compressed_vocab)
    return token_map


def install_token_map(model: Transformer, tokenizer: Tokenizer) -> None:
    """Set `tokenizer`'s map on a loaded model (on the model's device)."""
    model.set_token_map(model_token_map(tokenizer, model.cfg).to(model.device))
