"""The drafter's part of a step (after the postprocessor): DSpark rings updated, next drafts proposed.

    REPLAY work   the prompt's replayed window gives the draft inputs of its last positions: every choice of
                  the request (n > 1 forks included) gets drafter state with its rings seeded from them
    VERIFY work   the verifier left the accepted positions' draft inputs in ``spec.pending``: written
    then          every such sequence still decoding runs the stages over its ``dspark_block_size`` draft rows,
                  batched over sequences (model/dspark.py), then the Markov head's sequential loop here for
                  the first ``depth`` of them (drafts past the depth are never verified):
                  greedy requests take the argmax (q = one-hot), sampled ones draw from q = softmax(l / T)
                  with their own generator and keep q for the acceptance rule.

Sequences with a grammar (structured output) are not speculated: they decode one token per step.
"""

from __future__ import annotations

import torch

from flashtier.engine.model.dspark import confidence, draft_block, head_logits, markov, new_rings, ring_kv, write_rings
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.core.request import Request, Sequence
from flashtier.engine.core.request_state import RequestStatus
from flashtier.engine.runner.runner import ModelRunnerOutput
from flashtier.engine.core.scheduler_output import DecoderKind, SchedulerOutput
from flashtier.engine.spec.accept import draw
from flashtier.engine.spec.state import SpecState

Seed = tuple[Request, list[Sequence], torch.Tensor, int]  # (request, its sequences, draft inputs, first position)


class Drafter:
    def __init__(self, model: Transformer, depth: int):
        if len(model.mtp) == 0:
            raise ValueError("speculative decoding needs the model's DSpark stages (build it with_dspark=True)")
        if not 1 <= depth <= model.cfg.dspark_block_size:
            raise ValueError(f"depth must be in [1, {model.cfg.dspark_block_size}], got {depth}")
        self.model, self.depth = model, depth

    def eligible(self, req: Request, seq: Sequence) -> bool:
        """Whether a choice is speculated (one with a grammar decodes a token per step)."""
        return seq.grammar is None

    @torch.no_grad()
    def after_step(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Write this step's accepted draft inputs into the rings, then draft for every sequence that got one.

        Mutates the sequences' ``spec`` (rings, drafts, q, confidence; created for new decoders)."""
        seeds: list[Seed] = []
        for i, w in enumerate(sched.decoder):
            req = w.request
            if w.kind is DecoderKind.REPLAY and result.hidden is not None:
                hidden = result.hidden[result.hidden_slice(i)]
                seqs = [s for s in req.live_seqs if self.eligible(req, s)]
                for s in seqs:
                    s.spec = SpecState(new_rings(self.model.cfg, len(self.model.mtp), self.model.device,
                                                 self.model.compute_dtype))
                if seqs:
                    seeds.append((req, seqs, hidden, len(req.prompt) - hidden.shape[0]))
            elif w.kind is DecoderKind.VERIFY and w.seq.spec is not None and w.seq.spec.pending is not None:
                hidden, first = w.seq.spec.pending
                w.seq.spec.pending = None
                if not w.seq.finished:
                    seeds.append((req, [w.seq], hidden, first))
        if not seeds:
            return
        self._write(seeds)
        live = [(req, s) for req, seqs, _, _ in seeds if req.status is RequestStatus.DECODE
                for s in seqs if not s.finished]
        if live:
            self._propose(live)

    def _write(self, seeds: list[Seed]) -> None:
        """One ring-KV computation over every seed's rows, then each sequence's rings written."""
        dev = self.model.device
        hidden = torch.cat([h for _, _, h, _ in seeds])
        pos = torch.cat([torch.arange(f, f + h.shape[0], device=dev) for _, _, h, f in seeds])
        kv = ring_kv(self.model, hidden, pos)
        at = 0
        for _, seqs, h, _ in seeds:
            part = slice(at, at + h.shape[0])
            for s in seqs:
                write_rings(s.spec.rings, kv[:, part], pos[part])
            at += h.shape[0]

    def _propose(self, live: list[tuple[Request, Sequence]]) -> None:
        if not live:
            return
        model, dev = self.model, self.model.device
        last = torch.tensor([s.output[-1] for _, s in live], device=dev)
        pos = [len(r.prompt) + len(s.output) - 1 for r, s in live]
        x = draft_block(model, [s.spec.rings for _, s in live], last, torch.tensor(pos, device=dev))
        n = min(x.shape[1], self.depth)
        tokens, conf = [last], []
        qs: list[list[torch.Tensor]] = [[] for _ in live]
        for i in range(n):
            bias, me = markov(model, tokens[i])
            logits = (head_logits(model, x[:, i]) + bias).float()
            conf.append(confidence(model, x[:, i], me))
            nxt = logits.argmax(dim=-1)
            for b, (req, seq) in enumerate(live):
                if not req.params.is_greedy:  # draw from q = softmax(logits / T), keep q
                    q = (logits[b] / req.params.temperature).softmax(dim=-1)
                    qs[b].append(q)
                    nxt[b] = draw(q, seq.generator)
            tokens.append(nxt)
        drafts = torch.stack(tokens[1:], dim=1).tolist()
        scores = torch.stack(conf, dim=1)
        for b, (req, seq) in enumerate(live):
            spec = seq.spec
            spec.drafts, spec.draft_pos, spec.confidence = tuple(drafts[b]), pos[b], scores[b]
            spec.q = torch.stack(qs[b]) if qs[b] else None
