"""The oracle: a plain-torch forward over a whole sequence, driven by a ``Plan``.

No paging, no batching, no rings: every run processes all its positions at once, layer by layer, and
every window is an explicit position mask. The engine, every kernel and every resume path must
reproduce these logits (tests state the tolerance).

A plan is a list of turns. Each turn may start a new encoder run and may run the decoder::

    positions   0 ........ s=R-W ...... R ........ d=n-W ....... n ........ end
    encoder run            [=========== replay ===|=== new tokens ================>   window truncated at s,
                                                                                      global entries < R kept
    decoder run                                              [== replay ==|== decode ==>   window truncated at d

- (a) exact full pass          ``Plan.full(T)``: one encoder run and one decoder run over [0, T).
- (b) CED prefill + decode     ``Plan.ced(n, T, W)``: encoder over [0, T), decoder over [n - W, T).
- (c) encoder bounded replay   ``Plan.resume(R, n, T, W)``: a cold run caches [0, R); a second run
      re-encodes [R - W, T) with the window truncated at R - W, keeps the cached entries < R, then
      the decoder replays [n - W, T).
An exact (snapshot) resume is a turn with ``encoder_start=None``: the encoder simply continues.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.model.engram import ngram_ids
from flashtier.engine.model.layer_forward import (
    EntryStore,
    LocalKeys,
    StepSlots,
    layer_forward,
    project_decoder_entries,
)
from flashtier.engine.model.mhc import identity_pre
from flashtier.engine.model.transformer import Transformer


@dataclass(frozen=True)
class Turn:
    encoder_start: int | None  # first position of a new encoder run (None: continue the previous one)
    cached_until: int  # global entries of positions below this come from earlier runs
    decoder_start: int | None  # first position of this turn's decoder run (None: no decoder)
    end: int  # exclusive end of this turn


@dataclass(frozen=True)
class Plan:
    turns: tuple[Turn, ...]
    logits_from: int = 0  # return logits only for positions >= this

    @staticmethod
    def full(total: int, logits_from: int = 0) -> "Plan":
        return Plan((Turn(0, 0, 0, total),), logits_from)

    @staticmethod
    def ced(prompt_len: int, total: int, window: int) -> "Plan":
        return Plan((Turn(0, 0, max(0, prompt_len - window), total),), prompt_len - 1)

    @staticmethod
    def resume(resume_at: int, prompt_len: int, total: int, window: int) -> "Plan":
        if resume_at < window or resume_at > prompt_len:
            raise ValueError(f"resume point {resume_at} must lie in [window={window}, prompt_len={prompt_len}]")
        return Plan(
            (
                Turn(0, 0, None, resume_at),
                Turn(resume_at - window, resume_at, max(0, prompt_len - window), total),
            ),
            prompt_len - 1,
        )


@dataclass(frozen=True)
class ReferenceOutput:
    logits: torch.Tensor  # [T - logits_from, V] rows for positions logits_from .. T-1 (NaN: not computed)
    logits_from: int


def _new_stores(model: Transformer, capacity: int) -> dict[int, EntryStore]:
    cfg = model.cfg
    return {
        src: EntryStore(
            capacity // cfg.compress_ratios[src] + 1, cfg.head_dim, cfg.index_head_dim, model.device,
            model.compute_dtype,
        )
        for src in cfg.kv_source_layer_ids
    }


@torch.no_grad()
def reference_forward(model: Transformer, tokens: torch.Tensor, plan: Plan) -> ReferenceOutput:
    """Logits of ``tokens`` [T] under ``plan`` (see the module docstring)."""
    cfg = model.cfg
    dev = model.device
    tokens = tokens.to(dev)
    total = tokens.numel()
    w = cfg.sliding_window
    n_enc = cfg.n_encoder_layers
    stores = _new_stores(model, total)
    ngrams = ngram_ids(model.token_map, tokens, cfg.engram_max_ngram_size, int(model.token_map[cfg.engram_pad_token_id]))
    cdt = model.compute_dtype
    enc_x = torch.zeros(total, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=cdt)
    enc_pre = torch.zeros(total, cfg.hc_mult, device=dev, dtype=cdt)
    out = torch.full((total - plan.logits_from, cfg.vocab_size), float("nan"), device=dev)

    for turn in plan.turns:
        if turn.end > total:
            raise ValueError(f"plan turn ends at {turn.end} but only {total} tokens were given")
        if turn.encoder_start is not None:
            s, r = turn.encoder_start, turn.cached_until
            for src, store in stores.items():
                ratio = cfg.compress_ratios[src]
                if r % ratio:
                    raise ValueError(f"resume point {r} is not a multiple of ratio {ratio}")
                store.truncate(r // ratio)
            pos = torch.arange(s, total, device=dev)
            x = model.embed_streams(tokens[s:])
            pre = identity_pre(total - s, cfg.hc_mult, dev, cdt)
            slots = StepSlots()
            for layer in range(n_enc):
                block = model.layers[layer]
                if block.engram is not None:
                    x = block.engram(x, ngrams[s:])
                local = LocalKeys.empty(cfg.head_dim, start=s, device=dev, dtype=cdt)
                x, pre, _, _ = layer_forward(block, x, pre, pos, local, stores, slots, window=w, write_from=r)
            enc_x[s:], enc_pre[s:] = x, pre
            project_decoder_entries(model, x, pre, pos, stores[cfg.decoder_source], write_from=r)
        if turn.decoder_start is None:
            continue
        d, e = turn.decoder_start, turn.end
        pos = torch.arange(d, e, device=dev)
        x, pre = enc_x[d:e], enc_pre[d:e]
        slots = StepSlots()
        for layer in range(n_enc, cfg.num_hidden_layers):
            block = model.layers[layer]
            if block.engram is not None:
                x = block.engram(x, ngrams[d:e])
            local = LocalKeys.empty(cfg.head_dim, start=d, device=dev, dtype=cdt)
            x, pre, _, _ = layer_forward(block, x, pre, pos, local, stores, slots, window=w)
        lo = max(d, plan.logits_from)
        if lo < e:
            out[lo - plan.logits_from : e - plan.logits_from] = model.logits(x[lo - d :], pre[lo - d :])
    return ReferenceOutput(out, plan.logits_from)
