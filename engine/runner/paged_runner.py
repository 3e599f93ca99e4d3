"""Runs one ``SchedulerOutput`` with the batched forward over the paged stores (``model/paged_forward.py``).

    encoder part: RowSpan per EncoderWork (positions [len(tokens), + chunk), window from enc_start)
    decoder part: RowSpan per DecoderWork (REPLAY: [replay start, n) from the replay tail; DECODE: n - 1,
                  VERIFY: its chunk [n - rows, n), fed straight from this step's encoder rows)

A decode-shaped step (every sequence one token, or its verified chunk, through both parts) replays a CUDA graph
instead when graphs are on (``decode_graphs.py``), draft inputs included for a speculative engine. Mutates
what ``ModelRunner`` mutates (tokens, rings, pool entries, partial groups, replay tails). Every sequence of the
step must hold a ring-arena slot (``can_run``); the engine falls back to the per-sequence runner otherwise.
"""

from __future__ import annotations

import torch

from flashtier.engine.runner.decode_graphs import DecodeGraphs
from flashtier.engine.runner.decode_step import build_decode_step, decode_rows_of, install, is_decode_shaped
from flashtier.engine.kv.manager import KVManager
from flashtier.engine.model.batch_attention import PagedViews
from flashtier.engine.model.batch_forward import push_tail
from flashtier.engine.model.paged_forward import decode_rows, encode_rows
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.core.scheduler_output import DecoderKind, SchedulerOutput
from flashtier.engine.runner.rows import DecoderRowPlan, plan_rows
from flashtier.engine.runner.step_metadata import RowSpan, build_step_rows


class PagedRunner:
    def __init__(self, model: Transformer, kvm: KVManager, *, graphs: bool = False, max_graph_rows: int = 64,
                 graph_sizes: tuple[int, ...] = ()):
        """``graphs``: replay decode-shaped steps from CUDA graphs (decode_graphs.py) of up to ``max_graph_rows``
        rows."""
        assert kvm.arena is not None, "the paged runner needs the KV manager's ring arena"
        self.model, self.kvm = model, kvm
        cfg, spec = model.cfg, kvm.spec
        self.window, self.ngram = cfg.sliding_window, cfg.engram_max_ngram_size
        self.decoder_layers = range(cfg.n_encoder_layers, cfg.num_hidden_layers)
        streams = kvm.kv.streams
        ids = spec.source_layer_ids
        self.views = PagedViews(
            ring_data=kvm.arena.data, ring_pos=kvm.arena.pos,
            main={src: streams[i][0] for i, src in enumerate(ids)},
            index={src: streams[i][1] for i, src in enumerate(ids)},
        )
        per_block = kvm.layout.entries_per_block
        self.sources = {src: (r, per_block[i]) for i, (src, r) in enumerate(zip(ids, spec.source_ratios))}
        self.graphs = (DecodeGraphs(model, self.views, kvm.arena.pad_slot, self.sources, capture=True,
                                    max_rows=max_graph_rows, sizes=graph_sizes) if graphs else None)

    @staticmethod
    def can_run(batch: SchedulerOutput) -> bool:
        works = [*batch.encoder, *batch.decoder]
        return all(w.seq.kv.rings.slot is not None for w in works)

    @torch.no_grad()
    def execute(self, batch: SchedulerOutput, taps: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, DecoderRowPlan | None]:
        """(logits, draft inputs of the decoder rows, the row plan; spec/rows.py), Nones without decoder work.
        ``taps``: the layers whose block inputs are captured (a speculative engine)."""
        dev = self.model.device
        if (self.graphs is not None and is_decode_shaped(batch)
                and decode_rows_of(batch) <= self.graphs.max_rows):
            return self._graph_step(batch, taps)
        enc_x = enc_pre = None
        enc_last: dict[int, int] = {}  # id(kv) -> row of its newest encoder output in this step
        if batch.encoder:
            spans, ids = [], []
            for w in batch.encoder:
                kv = w.seq.kv
                start = len(kv.tokens)
                kv.tokens.extend(w.tokens)
                spans.append(RowSpan(kv, start, start + len(w.tokens), kv.enc_start))
                ids.extend(w.tokens)
            rows = build_step_rows(spans, self.window, self.ngram, dev, self.sources)
            states = [s.kv for s in spans]
            enc_x, enc_pre = encode_rows(self.model, states, rows, self.views, torch.tensor(ids, device=dev))
            at = 0
            for s in spans:  # the decoder replay's input: the newest `window` encoder outputs
                n = s.end - s.start
                push_tail(s.kv, enc_x[at : at + n], enc_pre[at : at + n], self.window)
                enc_last[id(s.kv)] = at + n - 1
                at += n
        if not batch.decoder:
            return None, None, None
        spans, xs, pres = [], [], []
        for w in batch.decoder:
            kv = w.seq.kv
            n = len(kv.tokens)
            if w.kind is DecoderKind.REPLAY:
                d = kv.begin_decoder_replay(self.decoder_layers)
                xs.append(kv.tail_x[-(n - d) :])
                pres.append(kv.tail_pre[-(n - d) :])
            else:
                d = n - w.rows
                r = enc_last[id(kv)] + 1
                xs.append(enc_x[r - w.rows : r])
                pres.append(enc_pre[r - w.rows : r])
            spans.append(RowSpan(kv, d, n, kv.dec_start))
        rows = build_step_rows(spans, self.window, self.ngram, dev)
        plan = plan_rows(batch.decoder, [s.end - s.start for s in spans], taps, dev)
        capture = plan.capture()
        logits = decode_rows(self.model, rows, self.views, torch.cat(xs), torch.cat(pres), capture=capture,
                             logit_rows=plan.logit_rows)
        return logits, plan.hidden(capture), plan

    def _graph_step(self, batch: SchedulerOutput, taps: tuple[int, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor | None, DecoderRowPlan]:
        """A decode-shaped step through the CUDA graphs (decode_step.py, decode_graphs.py): the logits of the
        rows the plan reads (every row of the graph's are computed) and, with ``taps``, every row's draft inputs."""
        dev = self.model.device
        step = build_decode_step(batch, self.window, self.ngram, self.sources, self.model.cfg.head_dim, dev)
        out = self.graphs.run(step, tuple(taps))
        install(step, out.x, out.pre, out.opened, self.window)
        plan = plan_rows(batch.decoder, [w.rows for w in batch.decoder], taps, dev)
        logits = out.logits if plan.logit_rows is None else out.logits[plan.logit_rows]
        return logits, out.hidden, plan
