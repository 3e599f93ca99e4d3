"""Runs one ``SchedulerOutput`` through the model: the encoder batch, then the decoder batch.

Mutates the sequences' KV state (tokens, rings, entries in the pool, partial groups, replay tails);
returns the logits of every decoder work item's last row (replay -> the first token, decode -> the
next one) as a ``ModelRunnerOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.model.batch_forward import decode_batch, encode_batch
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.paged_runner import PagedRunner
from flashtier.engine.scheduler_output import DecoderKind, SchedulerOutput


@dataclass(frozen=True)
class ModelRunnerOutput:
    """logits [len(SchedulerOutput.decoder), V], row i for decoder work i; None without decoder work."""

    logits: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: Transformer, paged: PagedRunner | None = None):
        """``paged``: run steps whose sequences all hold a ring-arena slot with the batched forward."""
        self.model, self.paged = model, paged
        self.decoder_layers = range(model.cfg.n_encoder_layers, model.cfg.num_hidden_layers)
        self.per_sequence_steps = 0  # steps the batched forward could not take (a sequence without a slot)

    @torch.no_grad()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        if self.paged is not None:
            if PagedRunner.can_run(batch):
                return ModelRunnerOutput(self.paged.execute(batch))
            self.per_sequence_steps += 1
        if batch.encoder:  # also keeps each sequence's replay tail
            encode_batch(self.model, [w.seq.kv for w in batch.encoder], [w.tokens for w in batch.encoder])
        if not batch.decoder:
            return ModelRunnerOutput()
        states, xs, pres, poss = [], [], [], []
        dev = self.model.device
        for work in batch.decoder:
            kv = work.seq.kv
            n = len(kv.tokens)
            d = kv.begin_decoder_replay(self.decoder_layers) if work.kind is DecoderKind.REPLAY else n - 1
            states.append(kv)
            xs.append(kv.tail_x[-(n - d) :])
            pres.append(kv.tail_pre[-(n - d) :])
            poss.append(torch.arange(d, n, device=dev))
        return ModelRunnerOutput(decode_batch(self.model, states, xs, pres, poss))
