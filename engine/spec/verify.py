"""The postprocessor's half of speculative decoding: accept each VERIFY work's drafts, roll its KV state back
to the accepted tokens, and leave the accepted positions' draft inputs for the drafter.

    VERIFY chunk  [ known tokens | d1 .. dD ]  at positions n0 .. n0 + rows - 1
    target rows   the last known row .. the last row (D + 1 rows, spec/accept.py)
    accepted a    tokens d1..da + one more: positions [n0, n0 + rows - D + a) are right
    rollback      to keep_point(...) tokens (spec/rollback.py), BEFORE full blocks are hashed

Every VERIFY row of the step is processed in one ``target_rows`` call (penalties see the drafts before each
row as generated tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.spec import accept as spec_accept
from flashtier.engine.kv.manager import KVManager
from flashtier.engine.core.outputs import TokenLogprob
from flashtier.engine.core.request import Request, Sequence
from flashtier.engine.runner.runner import ModelRunnerOutput
from flashtier.engine.sample.sampler import with_logprobs
from flashtier.engine.sample.row import ExtendedTokens, SamplerRow
from flashtier.engine.core.scheduler_output import DecoderKind, DecoderWork, SchedulerOutput
from flashtier.engine.kv.rollback import keep_point, rollback
from flashtier.engine.spec.stats import SpecStats


@dataclass(frozen=True)
class Verdict:
    """What one VERIFY work emits: accepted drafts then one token, with logprobs when the request asked."""

    request: Request
    seq: Sequence
    tokens: list[int]
    logprobs: list[TokenLogprob] | None


class SpecVerifier:
    def __init__(self, kvm: KVManager, stats: SpecStats, eos_token_id: int | None):
        self.kvm, self.stats, self.eos_token_id = kvm, stats, eos_token_id
        # a rollback keeps a multiple of this many tokens past the chunk start (no half-open ratio-2 group)
        self.align = 2 if kvm.spec.partial_order else 1

    def verify(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Verdict]:
        """Accept and roll back every VERIFY work of the step. Mutates the sequences' KV state, the pool
        (blocks past the kept tokens), their drafter state (drafts consumed, ``pending`` set), the
        generators of sampled sequences and the counters."""
        works = [(i, w) for i, w in enumerate(sched.decoder) if w.kind is DecoderKind.VERIFY]
        if not works or result.logits is None:
            return []
        index, rows = [], []
        for i, w in works:
            first = result.logit_slice(i).start + w.rows - len(w.drafts) - 1
            for j in range(len(w.drafts) + 1):
                index.append(first + j)
                rows.append(SamplerRow(w.request.params, ExtendedTokens(w.seq.output, w.drafts[:j]),
                                       w.request.penalty_prompt(result.logits.device), w.seq.generator))
        logits = result.logits[index]
        greedy_ids, probs = spec_accept.target_rows(logits, rows, self.eos_token_id)
        greedy = greedy_ids.tolist()
        out, at = [], 0
        for i, w in works:
            d = len(w.drafts)
            tokens = self._accept(w, greedy[at : at + d + 1], None if probs is None else probs[at : at + d + 1])
            out.append(Verdict(w.request, w.seq, tokens, self._logprobs(w, logits[at : at + len(tokens)], tokens)))
            self._roll_back(i, w, len(tokens) - 1, result)
            at += d + 1
        return out

    def _accept(self, w: DecoderWork, greedy: list[int], probs: torch.Tensor | None) -> list[int]:
        if w.request.params.is_greedy:
            return spec_accept.accept_greedy(greedy, w.drafts)
        q = w.seq.spec.q
        return spec_accept.accept_sampled(probs, w.drafts, None if q is None else q[: len(w.drafts)],
                                          w.seq.generator)

    def _roll_back(self, i: int, w: DecoderWork, n_accepted: int, result: ModelRunnerOutput) -> None:
        cp, spec = result.checkpoints[i], w.seq.spec
        right = cp.n0 + w.rows - len(w.drafts) + n_accepted  # positions [n0, right) hold the right tokens
        rollback(self.kvm, w.seq.kv, cp, keep_point(cp.n0, w.rows, right, self.align))
        spec.pending = (result.hidden[result.hidden_slice(i)][: right - cp.n0], cp.n0)
        spec.drafts, spec.q, spec.confidence = (), None, None
        self.stats.record(len(w.drafts), n_accepted)

    @staticmethod
    def _logprobs(w: DecoderWork, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """Raw-model logprobs of the emitted tokens (sampler step 1), one target row each."""
        p = w.request.params
        if p.logprobs is None:
            return None
        ids = torch.tensor(tokens, device=logits.device)
        lp = with_logprobs(ids, logits.float().log_softmax(dim=-1), [p] * len(tokens))
        k = p.logprobs
        return [TokenLogprob(t, float(lp.logprobs[j]), int(lp.ranks[j]),
                             tuple(zip(lp.top_logprob_ids[j, :k].tolist(), lp.top_logprobs[j, :k].tolist())))
                for j, t in enumerate(tokens)]
