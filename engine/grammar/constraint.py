"""What a request's output must match: ``ConstraintSpec`` (the grammar as the API gave it) and
``OutputConstraint`` (compiled, carried by ``SamplingParams``), plus the per-choice ``GrammarState``.

    server: tool_choice / response_format / structured_outputs ──▶ ConstraintSpec
            ──GrammarCompiler.compile (worker thread, cached)──▶ OutputConstraint in SamplingParams
    engine: one GrammarState per choice; before sampling, its token bitmask; after, the sampled token.

``begin_after_token`` lets a thinking-mode answer reason freely: the grammar applies from the token
after the first ``</think>`` the choice generates (the prompt ends in ``<think>``). Without it the
grammar applies from the first generated token.

xgrammar (the grammar engine vLLM and SGLang use by default) does the matching; its masks cost about
11 µs per token for a JSON schema over the 129,280-token vocabulary (llguidance: ~130 µs on the same
schema; docs/structured_output.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

__all__ = ["ConstraintKind", "ConstraintSpec", "GrammarState", "OutputConstraint"]


class ConstraintKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # source: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; source unused
    REGEX = "regex"
    CHOICE = "choice"  # source: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # source: EBNF (GBNF-style, as vLLM's `grammar`)
    STRUCTURAL_TAG = "structural_tag"  # source: an xgrammar structural tag as JSON text (tool calls)


@dataclass(frozen=True)
class ConstraintSpec:
    """A grammar before compilation. ``label`` names it in errors and logs (e.g. "tool_choice")."""

    kind: ConstraintKind
    source: str
    label: str
    any_whitespace: bool = True  # JSON: False writes it compact (vLLM's disable_any_whitespace)


@dataclass(frozen=True, eq=False)
class OutputConstraint:
    """A compiled grammar and when it starts to apply; shared by every choice of a request (read-only)."""

    grammar: xgr.CompiledGrammar
    begin_after_token: int | None
    label: str


class GrammarState:
    """One choice's position in its grammar. Owned by the choice's ``Sequence``; engine thread only.

    ``active`` is False until ``begin_after_token`` was generated (always True without one).
    ``fill`` writes the allowed-token bitmask row; ``accept`` advances by the sampled token and
    returns False if the grammar rejects it (cannot happen for a token sampled under the mask; the
    caller ends the choice). After the grammar completes only the stop tokens are allowed.
    """

    def __init__(self, constraint: OutputConstraint) -> None:
        self.constraint = constraint
        import xgrammar as xgr  # imported by then: the grammar was compiled or deserialised with it

        self.matcher = xgr.GrammarMatcher(constraint.grammar)
        self.active = constraint.begin_after_token is None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Mutates ``bitmask[row]`` (int32, 32 tokens per word) to the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; mutates the matcher (or activates it on ``begin_after_token``)."""
        if not self.active:
            self.active = token_id == self.constraint.begin_after_token
            return True
        return bool(self.matcher.accept_token(token_id))
