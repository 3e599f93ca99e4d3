"""The drafter's part of a step: DSpark rings updated after the step, drafts proposed at the next one's start.

    REPLAY work   the prompt's replayed window gives the draft inputs of its last positions: every choice of
                  the request (n > 1 forks included) gets drafter state with its rings seeded from them
    VERIFY work   the verifier left the accepted positions' draft inputs in ``spec.pending``: written
    DECODE work   a speculating sequence decoded without drafts (the goodput controller chose 0): no draft
                  inputs came back (the step may have been a CUDA graph), so its rings miss that position
                  (``SpecState.synced`` turns False)
    next step     when the controller's draft length k is > 0, ``propose_for`` runs the stages over the
                  ``dspark_block_size`` draft rows of every running sequence whose drafts are stale, batched
                  over sequences (model/dspark.py), then the Markov head's sequential loop here for the first
                  k of them (drafts past k are never verified): greedy requests take the argmax (q = one-hot),
                  sampled ones draw from q = softmax(l / T) with their own generator and keep q for the
                  acceptance rule (the draws' noise drawn first, spec/draft_graphs.py). A proposal replays a
                  CUDA graph when the engine has them: the same program over padded rows.

Proposing at the start of the step that verifies the drafts (not at the end of the step before) lets the
controller decide first: a step without drafts costs no drafting.

Sequences with a grammar (structured output) are not speculated: they decode one token per step.
"""

from __future__ import annotations

import torch

from flashtier.engine.model.dspark import draft_block, new_rings, ring_kv, write_rings
from flashtier.engine.model.transformer import Transformer
from collections.abc import Iterable

from flashtier.engine.core.request import Request, Sequence
from flashtier.engine.core.request_state import RequestStatus
from flashtier.engine.runner.runner import ModelRunnerOutput
from flashtier.engine.core.scheduler_output import DecoderKind, SchedulerOutput
from flashtier.engine.spec.draft_graphs import DraftGraphs, DraftSampling, draw_noise, propose_rows
from flashtier.engine.spec.state import SpecState

Seed = tuple[Request, list[Sequence], torch.Tensor, int]  # (request, its sequences, draft inputs, first position)


class Drafter:
    def __init__(self, model: Transformer, depth: int, graphs: DraftGraphs | None = None):
        """``graphs``: replay proposals from CUDA graphs (spec/draft_graphs.py; None: every proposal eager)."""
        if len(model.mtp) == 0:
            raise ValueError("speculative decoding needs the model's DSpark stages (build it with_dspark=True)")
        if not 1 <= depth <= model.cfg.dspark_block_size:
            raise ValueError(f"depth must be in [1, {model.cfg.dspark_block_size}], got {depth}")
        self.model, self.depth, self.graphs = model, depth, graphs

    def eligible(self, req: Request, seq: Sequence) -> bool:
        """Whether a choice is speculated (one with a grammar decodes a token per step)."""
        return seq.grammar is None

    @torch.no_grad()
    def after_step(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Write this step's accepted draft inputs into the rings (``propose_for`` drafts at the next step).

        Mutates the sequences' ``spec`` (rings, ``pending`` consumed, ``synced``; created for new decoders)."""
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
            elif w.kind is DecoderKind.DECODE and w.seq.spec is not None:
                w.seq.spec.synced = False
        if seeds:
            self._write(seeds)

    @torch.no_grad()
    def propose_for(self, requests: Iterable[Request], n: int) -> None:
        """Draft ``n`` tokens (1 <= n <= depth) for every decoding sequence of ``requests`` whose drafts do not
        follow its last token. Mutates those sequences' ``spec`` (drafts, q, confidence) and the generators of
        sampled ones."""
        live = [(req, s) for req in requests if req.status is RequestStatus.DECODE for s in req.live_seqs
                if s.spec is not None and s.output and s.spec.draft_pos != len(req.prompt) + len(s.output) - 1]
        if live:
            self.propose(live, n)

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

    def propose(self, live: list[tuple[Request, Sequence]], n: int) -> None:
        """Draft ``n`` tokens for each of ``live`` (the proposal itself; a benchmark's oracle drafter overrides it):
        the sampling rows' noise drawn first from their generators, then the program, replayed from a graph when
        the engine has them and the batch fits (spec/draft_graphs.py). Mutates the sequences' ``spec`` and the
        generators of sampled requests."""
        if not live:
            return
        model, dev = self.model, self.model.device
        last = torch.tensor([s.output[-1] for _, s in live], device=dev)
        pos = [len(r.prompt) + len(s.output) - 1 for r, s in live]
        positions, rings = torch.tensor(pos, device=dev), [s.spec.rings for _, s in live]
        k = min(model.cfg.dspark_block_size, self.depth, n)
        rows = [b for b, (req, _) in enumerate(live) if not req.params.is_greedy]
        sampling = None
        if rows:  # draw from q = softmax(logits / T) with each request's generator, keep q
            noise = draw_noise([live[b][1].generator for b in rows], k, model.cfg.vocab_size, dev)
            sampling = DraftSampling(tuple(rows), tuple(live[b][0].params.temperature for b in rows), noise)
        if self.graphs is not None and len(live) <= self.graphs.max_rows:
            out = self.graphs.run(rings, last, positions, k, sampling)
        else:
            out = propose_rows(model, draft_block(model, rings, last, positions), last, k, sampling)
        drafts, sampled = out.drafts.tolist(), set(rows)
        for b, (_, seq) in enumerate(live):
            spec = seq.spec
            spec.drafts, spec.draft_pos, spec.confidence = tuple(drafts[b]), pos[b], out.confidence[b]
            spec.q = out.q[b] if b in sampled else None
