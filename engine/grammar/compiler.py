"""``GrammarCompiler``: ``ConstraintSpec`` -> ``OutputConstraint`` over the model's vocabulary.

The vocabulary is given as token strings (``GrammarVocab``): the byte-level BPE strings of the
tokenizer, with every control token blanked so that no grammar can emit one (`<think>`, `<｜User｜>`,
...), except the few the output markup itself needs (``｜DSML｜`` in tool calls). The stop tokens end a
completed grammar. Compiling takes milliseconds to a few hundred (large schemas); call it on a worker
thread. xgrammar caches compiled grammars by source, so a schema sent every turn compiles once.

Failure: ``compile`` raises ``ConstraintError`` (a ValueError) naming the spec's label and what the
grammar engine reported; the server answers it as a 400.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashtier.engine.grammar.constraint import ConstraintKind, ConstraintSpec, OutputConstraint

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar is imported where a grammar is first used: it imports transformers (0.8 s per process), which
# a server that never constrains an output need not pay (the engine's warm-up imports it ahead of requests)

__all__ = ["MAX_WHITESPACE", "ConstraintError", "GrammarCompiler", "GrammarVocab"]

# JSON (and the gaps of the tool-call markup) may carry at most this many whitespace characters in a
# row: a model that keeps choosing whitespace (small or random models do) cannot run the answer to
# max_tokens inside one gap. 32 still fits a newline plus seven levels of 4-space indentation.
MAX_WHITESPACE = 32


class ConstraintError(ValueError):
    """A grammar the engine cannot compile; the message names the request field."""


@dataclass(frozen=True)
class GrammarVocab:
    """Token id -> its byte-level string ("" = never allowed), the stop ids and the logits width."""

    tokens: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    vocab_size: int


class GrammarCompiler:
    """Thread-safe: xgrammar's compiler is, and ``compile`` keeps no state besides its cache."""

    def __init__(self, vocab: GrammarVocab, *, threads: int = 2) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo(list(vocab.tokens), xgr.VocabType.BYTE_LEVEL, vocab_size=vocab.vocab_size,
                                 stop_token_ids=list(vocab.stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self._lock = threading.Lock()  # xgrammar's cache is safe; the lock only serialises first use
        self.vocab_size = vocab.vocab_size

    def compile(self, spec: ConstraintSpec, *, begin_after_token: int | None = None) -> OutputConstraint:
        """Compile ``spec``; raises ``ConstraintError`` when the grammar engine rejects it."""
        try:
            grammar = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConstraintError(f"{spec.label}: the grammar engine cannot compile it: {reason}") from None
        return OutputConstraint(grammar, begin_after_token, spec.label)

    def _compile(self, spec: ConstraintSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        kind = spec.kind
        if kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT):
            schema = spec.source if kind is ConstraintKind.JSON_SCHEMA else '{"type": "object"}'
            if not spec.any_whitespace:
                return c.compile_json_schema(schema, any_whitespace=False)
            return c.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)
        if kind is ConstraintKind.REGEX:
            return c.compile_regex(spec.source)
        if kind is ConstraintKind.CHOICE:
            import xgrammar as xgr

            choices = json.loads(spec.source)
            return c.compile_grammar(xgr.Grammar.from_ebnf(_choice_ebnf(choices)))
        if kind is ConstraintKind.GRAMMAR:
            return c.compile_grammar(spec.source)
        if kind is ConstraintKind.STRUCTURAL_TAG:
            return c.compile_structural_tag(spec.source)
        raise ValueError(f"unknown constraint kind {kind!r}")


def _choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"`` with JSON string escaping (EBNF literals use the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
