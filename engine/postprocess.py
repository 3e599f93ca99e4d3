"""After the forward: register full blocks (and write them through), snapshot at prompt end, turn
finished replays into decodes (forking n > 1), sample one token per live sequence, end choices.

    SchedulerOutput + ModelRunnerOutput ──▶ Postprocessor.process ──▶ the requests touched this step

Speculative engines first accept each VERIFY work's drafts and roll its KV state back (spec/verify.py),
before any block is hashed; the accepted tokens then go through the same per-token path as sampled ones.

Runs on the engine thread; mutates requests, sequences and (through the scheduler) the pool.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from flashtier.engine.grammar.mask import grammar_bitmask
from flashtier.engine.core.outputs import TokenLogprob
from flashtier.engine.core.request import FinishReason, Request, Sequence
from flashtier.engine.core.request_state import RequestStatus
from flashtier.engine.runner.runner import ModelRunnerOutput
from flashtier.engine.sample.sampler import Sampler, SamplerRow
from flashtier.engine.scheduler import Scheduler
from flashtier.engine.core.scheduler_output import DecoderKind, SchedulerOutput
from flashtier.engine.spec.verify import SpecVerifier

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One sequence to sample, from logits row ``row`` (n > 1 choices share their replay's row)."""

    request: Request
    seq: Sequence
    row: int


class Postprocessor:
    def __init__(self, scheduler: Scheduler, sampler: Sampler, *, eos_token_id: int, max_model_len: int,
                 verifier: SpecVerifier | None = None):
        self.scheduler = scheduler
        self.sampler = sampler
        self.verifier = verifier
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.generation_tokens = 0  # monotonic

    def process(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Apply one step's results; returns the requests that got tokens (each once, in order)."""
        kvm, tiers = self.scheduler.kvm, self.scheduler.tiers
        verdicts = self.verifier.verify(sched, result) if self.verifier is not None else []
        for w in sched.encoder:
            blocks = kvm.cache_full_blocks(w.seq, w.request.namespace)
            if tiers is not None:
                tiers.write_through(w.request, blocks)
                if w.request.status is RequestStatus.REPLAY and len(w.seq.kv.tokens) == len(w.request.prompt):
                    tiers.snapshot(w.request, w.seq)  # prompt end
        if result.logits is None:
            return []
        rows: list[SampleRow] = []
        touched: dict[int, Request] = {}
        for i, w in enumerate(sched.decoder):
            row = result.logit_slice(i).stop - 1  # REPLAY and DECODE read their last row
            if w.kind is DecoderKind.REPLAY:
                self.scheduler.start_decode(w.request)
                rows.extend(SampleRow(w.request, s, row) for s in w.request.live_seqs)
            elif w.kind is DecoderKind.DECODE:
                rows.append(SampleRow(w.request, w.seq, row))
            touched[id(w.request)] = w.request
        self._sample(rows, result.logits)
        now = time.monotonic()
        for v in verdicts:
            for j, tok in enumerate(v.tokens):
                if not self._emit(v.request, v.seq, tok, None if v.logprobs is None else v.logprobs[j], now):
                    break
        return list(touched.values())

    def _sample(self, rows: list[SampleRow], logits: torch.Tensor) -> None:
        if not rows:
            return
        out = self.sampler(logits[[r.row for r in rows]],
                           [SamplerRow(r.request.params, r.seq.output, r.request.penalty_prompt(logits.device),
                                       r.seq.generator) for r in rows],
                           token_bitmask=grammar_bitmask([r.seq.grammar for r in rows], logits.shape[1]))
        now = time.monotonic()
        for j, (r, tok) in enumerate(zip(rows, out.token_ids.tolist())):
            lp = None
            if r.request.params.logprobs is not None:
                k = r.request.params.logprobs
                lp = TokenLogprob(tok, float(out.logprobs[j]), int(out.ranks[j]),
                                  tuple(zip(out.top_logprob_ids[j, :k].tolist(), out.top_logprobs[j, :k].tolist())))
            self._emit(r.request, r.seq, tok, lp, now)

    def _emit(self, req: Request, seq: Sequence, tok: int, lp: TokenLogprob | None, now: float) -> bool:
        """Hand one token to a choice: grammar, logprobs, EOS / stop tokens, max_tokens, context length.
        Returns whether the choice goes on. Mutates the sequence and (finishing) the scheduler's state."""
        p = req.params
        if req.first_token is None:
            req.first_token = now
        if seq.grammar is not None and not seq.grammar.accept(tok):
            # cannot happen for a token drawn under the mask; never hand out text the grammar rejects
            logger.error("request %s: the grammar (%s) rejected sampled token %d; ending the choice",
                         req.request_id, seq.grammar.constraint.label, tok)
            self.scheduler.finish_seq(req, seq, FinishReason.ABORT)
            return False
        self.generation_tokens += 1
        if (tok == self.eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids:
            self.scheduler.finish_seq(req, seq, FinishReason.STOP, tok)
            return False
        if lp is not None:
            seq.logprobs.append(lp)
        seq.output.append(tok)
        if len(seq.output) >= p.max_tokens or len(req.prompt) + len(seq.output) >= self.max_model_len:
            self.scheduler.finish_seq(req, seq, FinishReason.LENGTH)
            return False
        return True
