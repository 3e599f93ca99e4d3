"""Runs one ``SchedulerOutput`` through the model: the encoder batch, then the decoder batch.

Mutates the sequences' KV state (tokens, rings, entries in the pool, partial groups, replay tails);
returns the logits of every decoder work item's last row (replay -> the first token, decode -> the
next one) as a ``ModelRunnerOutput``. Speculative engines (``taps``: DSpark's target layers) also get
the logits of every VERIFY row, the draft inputs of every decoder row (spec/rows.py) and, per VERIFY
work, the checkpoint its rejected positions roll back to (spec/rollback.py, taken before the forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashtier.engine.model.batch_forward import decode_batch, encode_batch
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.runner.paged_runner import PagedRunner
from flashtier.engine.core.scheduler_output import DecoderKind, SchedulerOutput
from flashtier.engine.kv.rollback import SpecCheckpoint, take_checkpoint
from flashtier.engine.runner.rows import DecoderRowPlan, plan_rows


@dataclass(frozen=True)
class ModelRunnerOutput:
    """logits: decoder work i's rows are ``logit_slice(i)`` (row i unless the engine is speculative); None
    without decoder work. hidden [T, n_taps, D]: draft inputs of the decoder rows, work i's ``hidden_slice(i)``.
    checkpoints: per decoder work, the state before the step of a VERIFY work (else None)."""

    logits: torch.Tensor | None = None
    logit_offsets: tuple[int, ...] = ()
    hidden: torch.Tensor | None = None
    hidden_offsets: tuple[int, ...] = ()
    checkpoints: tuple[SpecCheckpoint | None, ...] = ()

    def logit_slice(self, i: int) -> slice:
        off = self.logit_offsets
        return slice(off[i], off[i + 1]) if off else slice(i, i + 1)

    def hidden_slice(self, i: int) -> slice:
        return slice(self.hidden_offsets[i], self.hidden_offsets[i + 1])


class ModelRunner:
    def __init__(self, model: Transformer, paged: PagedRunner | None = None, taps: Sequence[int] = ()):
        """``paged``: run steps whose sequences all hold a ring-arena slot with the batched forward.
        ``taps``: capture the block inputs of these layers (DSpark's draft inputs); empty: a plain engine."""
        self.model, self.paged, self.taps = model, paged, tuple(taps)
        self.decoder_layers = range(model.cfg.n_encoder_layers, model.cfg.num_hidden_layers)
        self.per_sequence_steps = 0  # steps the batched forward could not take (a sequence without a slot)

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step's forward. On the CPU under ``torch.inference_mode`` (no version counters or view
        tracking: ~15-20% of a tiny-model step, whose ops are small), elsewhere under ``no_grad`` (CUDA graphs
        replay most steps there). Tensors made here that outlive the step (the replay tails, the logits) are
        then inference tensors: read anywhere, never updated in place outside a step."""
        with torch.inference_mode() if self.model.device.type == "cpu" else torch.no_grad():
            return self._execute(batch)

    def _execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        checkpoints = tuple(take_checkpoint(w.seq.kv, w.rows) if w.kind is DecoderKind.VERIFY else None
                            for w in batch.decoder)
        # draft inputs are read after REPLAY and VERIFY work only: a step of plain DECODE work captures none (and
        # may replay a CUDA graph)
        taps = self.taps if any(w.kind is not DecoderKind.DECODE for w in batch.decoder) else ()
        if self.paged is not None:
            if PagedRunner.can_run(batch):
                return self._output(*self.paged.execute(batch, taps), checkpoints)
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
            d = kv.begin_decoder_replay(self.decoder_layers) if work.kind is DecoderKind.REPLAY else n - work.rows
            states.append(kv)
            xs.append(kv.tail_x[-(n - d) :])
            pres.append(kv.tail_pre[-(n - d) :])
            poss.append(torch.arange(d, n, device=dev))
        plan = plan_rows(batch.decoder, [p.numel() for p in poss], taps, dev)
        capture = plan.capture()
        logits = decode_batch(self.model, states, xs, pres, poss, capture=capture, logit_rows=plan.logit_rows)
        return self._output(logits, plan.hidden(capture), plan, checkpoints)

    @staticmethod
    def _output(logits: torch.Tensor | None, hidden: torch.Tensor | None, plan: DecoderRowPlan | None,
                checkpoints: tuple[SpecCheckpoint | None, ...]) -> ModelRunnerOutput:
        if logits is None or plan is None:
            return ModelRunnerOutput()
        return ModelRunnerOutput(logits, plan.logit_offsets, hidden, plan.hidden_offsets, checkpoints)
