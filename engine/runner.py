"""Runs one ``SchedulerOutput`` through the model: the encoder batch, then the decoder batch.

Returns the logits of every decoder work item's last row (replay -> the first token, decode -> the
next one). Mutates the sequences' KV state (rings, entries in the pool, partial groups, tails).
"""

from __future__ import annotations

import torch

from .model.batch_forward import decode_batch, encode_batch
from .model.transformer import Transformer
from .scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: Transformer):
        self.model = model
        self.window = model.cfg.sliding_window
        self.decoder_layers = range(model.cfg.n_encoder_layers, model.cfg.num_hidden_layers)

    @torch.no_grad()
    def execute(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """Logits [len(batch.decoder), V] (None when there is no decoder work)."""
        if batch.encoder:  # also keeps each sequence's replay tail
            encode_batch(self.model, [w.seq.kv for w in batch.encoder], [w.tokens for w in batch.encoder])
        if not batch.decoder:
            return None
        states, xs, pres, poss = [], [], [], []
        dev = self.model.device
        for work in batch.decoder:
            kv = work.seq.kv
            n = len(kv.tokens)
            if work.kind == "replay":
                d = max(kv.enc_start, n - self.window, 0)
                kv.rings.clear(self.decoder_layers)
                kv.dec_start = d
            else:
                d = n - 1
            states.append(kv)
            xs.append(kv.tail_x[-(n - d) :])
            pres.append(kv.tail_pre[-(n - d) :])
            poss.append(torch.arange(d, n, device=dev))
        return decode_batch(self.model, states, xs, pres, poss)
