"""A sequence's speculative-decoding (DSpark) state between steps, and its invariants.

    step t:   VERIFY [known tokens | drafts] ──▶ accept a drafts, roll the KV state back, sample one token
              drafter: write the accepted positions' draft inputs into the rings, propose the next drafts
    step t+1: drafter: propose the next drafts (when the goodput controller's draft length is > 0)
              VERIFY [known tokens | drafts[:k]]   k from the confidence schedule (spec/schedule.py), at most
              the controller's draft length (spec/controller.py); at draft length 0 a sequence with one
              known token runs a plain DECODE step instead, and its rings miss that position (``synced``)

``known`` are the tokens of the sequence not yet in its KV state: the last sampled token, and at most one
accepted token before it (a rollback keeps an even number of tokens, so that no ratio-2 group stays half
open, spec/rollback.py; that token is fed again with the next step's chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.model.dspark import DSparkRings
from flashtier.engine.core.request import Request


@dataclass
class SpecState:
    """The drafter's windows of one sequence and the drafts it proposed (mutated by the drafter and verifier)."""

    rings: DSparkRings
    drafts: tuple[int, ...] = ()  # proposed tokens for positions draft_pos + 1, ...
    draft_pos: int = -1  # position of the token the drafts follow; drafts for another position are stale
    q: torch.Tensor | None = None  # [len(drafts), V] fp32 draft distributions (sampled drafts); None: greedy
    confidence: torch.Tensor | None = None  # [len(drafts)] the confidence head's acceptance scores (logits)
    pending: tuple[torch.Tensor, int] | None = None  # (draft inputs [T, n_src, D], first position) to write
    synced: bool = True  # the rings hold every position verified so far (False after a plain DECODE step)

    def drafts_for(self, position: int) -> tuple[int, ...]:
        """The drafts that follow the token at ``position`` (empty when they were made for another one)."""
        return self.drafts if self.draft_pos == position else ()


def known_tokens(req: Request, seq) -> list[int]:
    """The sequence's tokens that are not in its KV state yet (what the next chunk feeds before any draft)."""
    return seq.output[len(seq.kv.tokens) - len(req.prompt) :]


def check_spec_integrity(requests, pool, block_size: int) -> None:
    """Every speculating sequence's KV state is a prefix of its tokens lagging by one or two (one pending
    after an odd rollback), only blocks holding kept tokens alone are registered in the prefix cache, and
    its drafter rings end right before its last token (never past it, once it decoded a step without
    speculation). Raises RuntimeError."""
    for req in requests:
        for seq in req.live_seqs:
            if seq.swapped is not None or not seq.output or seq.spec is None:
                continue
            kv, total = seq.kv, len(req.prompt) + len(seq.output)
            lag = total - len(kv.tokens)
            if lag not in (1, 2) or kv.tokens != (req.prompt + seq.output)[: len(kv.tokens)]:
                raise RuntimeError(f"{req.request_id}: KV holds {len(kv.tokens)} tokens of {total} (lag {lag})")
            full = len(kv.tokens) // block_size
            hashed = [k for k, b in enumerate(kv.table.ids) if pool.blocks[b].block_hash is not None]
            if len(seq.hashes) > full or any(k >= full for k in hashed):
                raise RuntimeError(f"{req.request_id}: a block past the {len(kv.tokens)} kept tokens is hashed")
            newest = seq.spec.rings.newest
            if seq.spec.pending is None and (newest != total - 2 if seq.spec.synced else newest > total - 2):
                raise RuntimeError(f"{req.request_id}: drafter rings end at {newest}, expected {total - 2}")
