"""``GrammarService``: the server's grammar compiler, built on first use from the tokenizer.

The vocabulary handed to the grammar engine is the tokenizer's byte-level strings with every added
(control) token blanked, so no constrained output can contain `<think>`, `<｜User｜>`, EOS text and the
like; ``｜DSML｜`` stays, because the tool-call markup is written with it. Building the compiler takes
about a second (the vocabulary is scanned once) and compiling a schema milliseconds to a few hundred:
both run on a worker thread, never on the event loop.

Failure: ``compile`` raises ``BadRequest`` (400) naming the request field whose grammar does not
compile; the engine never sees it.
"""

from __future__ import annotations

import asyncio
import re
import threading

from flashtier.engine.grammar.compiler import ConstraintError, GrammarCompiler, GrammarVocab
from flashtier.engine.grammar.constraint import ConstraintSpec, OutputConstraint
from flashtier.server.text.dsml_markup import DSML_TOKEN
from flashtier.server.http.errors import BadRequest
from flashtier.server.text.tokenizer import Tokenizer

__all__ = ["GrammarService", "grammar_vocab"]

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:line: "; the client needs only the rest
_LOCATION = re.compile(r"\[[\d:]+\]\s+\S+:\d+:\s*")
MARKUP_TOKENS = frozenset({DSML_TOKEN})


def grammar_vocab(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarVocab:
    """The tokenizer's vocabulary as the grammar engine sees it (control tokens blanked)."""
    tokens = [""] * vocab_size
    for text, token_id in tokenizer.vocab().items():
        if token_id < vocab_size:
            tokens[token_id] = text
    for text, token_id in tokenizer.special_tokens.items():
        if text not in MARKUP_TOKENS and token_id < vocab_size:
            tokens[token_id] = ""
    return GrammarVocab(tuple(tokens), stop_token_ids, vocab_size)


class GrammarService:
    """One compiler per server; ``compile`` is safe to call from many requests at once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _get(self, vocab_size: int, eos_token_id: int) -> GrammarCompiler:
        with self._lock:  # the first requests to need it build it once
            if self._compiler is None or self._compiler.vocab_size != vocab_size:
                vocab = grammar_vocab(self._tokenizer, vocab_size, (eos_token_id,))
                self._compiler = GrammarCompiler(vocab)
            return self._compiler

    async def compile(self, spec: ConstraintSpec, *, vocab_size: int, eos_token_id: int,
                      begin_after_token: int | None) -> OutputConstraint:
        """Compile on a worker thread; 400 naming ``spec.label`` when the grammar engine rejects it."""

        def work() -> OutputConstraint:
            return self._get(vocab_size, eos_token_id).compile(spec, begin_after_token=begin_after_token)

        try:
            return await asyncio.to_thread(work)
        except ConstraintError as exc:
            raise BadRequest(_LOCATION.sub("", str(exc)), param=spec.label.split(".")[0],
                             code="invalid_output_constraint") from None
