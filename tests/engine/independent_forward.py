"""A second reference forward of the V4.1 backbone, written from reference/model.md, for checking the engine.

It shares no code with ``engine/model`` or ``kernels/``: it reads the parameters from a model's
``state_dict`` by their checkpoint names (``layers.L.attn.wq_a.weight``, ...), the hyper-parameters from its
config and the Engram token map, and computes everything else itself in float64 (``independent_layers.py``,
``independent_quant.py``). The plans are the ones of docs/model.md ("Visibility, plans and replay")::

    full(T)            one encoder run and one decoder run over [0, T)
    ced(n, T, W)       encoder over [0, T); decoder over [n - W, T), its window truncated at n - W
    resume(R, n, T, W) encoder over [0, R); a second one over [R - W, T), window truncated at R - W, that
                       keeps the global entries < R of the first; then the decoder as in ced

``ACT_QUANT``: the official code quantises the input of every linear whose weight is FP8 or FP4 (e4m3, one
power-of-two scale per 32, ``act_quant`` in ``linear()``): attention wq_a, wq_b, wkv, wo_b; indexer wq_b;
Engram wkv; routed and shared experts w1, w3 (their input) and w2 (the weighted SwiGLU output). Not: wo_a
(a bf16 einsum), the compressor, indexer weights_proj and wk, the gate, the head, the mHC projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .independent_layers import (
    attention, candidate_mask, collapse, engram, engram_rows, expand, hc_mix, moe, rms_norm, rope, rope_freqs,
    topk_mask,
)
from .independent_quant import fp4_qdq, fp8_qdq, mxfp4_qdq

ACT_QUANT = True  # quantise the inputs of the FP8/FP4-weight linears, as the official linear() does


@dataclass(frozen=True)
class Turn:
    encoder_start: int | None  # a new encoder run from here (None: no encoder run in this turn)
    cached_until: int  # global entries of positions below this are kept from earlier runs
    decoder_start: int | None  # a decoder run from here (None: none)
    end: int


def plan_full(total: int, logits_from: int = 0) -> tuple[list[Turn], int]:
    return [Turn(0, 0, 0, total)], logits_from


def plan_ced(n: int, total: int, window: int) -> tuple[list[Turn], int]:
    return [Turn(0, 0, max(0, n - window), total)], n - 1


def plan_resume(r: int, n: int, total: int, window: int) -> tuple[list[Turn], int]:
    return [Turn(0, 0, None, r), Turn(r - window, r, max(0, n - window), total)], n - 1


class Weights:
    """Checkpoint tensors of a model by name (float64), its config, its Engram token map."""

    def __init__(self, model):
        self.cfg = model.cfg
        self.token_map = model.token_map.cpu()
        self._sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sd[name].to(torch.float64)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self[name].T

    def fp8_linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.linear(fp8_qdq(x) if ACT_QUANT else x, name)


@dataclass(frozen=True)
class Role:
    ratio: int  # 0: window only; 2: encoder global KV; 1: decoder global KV
    kind: str  # swa | full (compressor + indexer) | reindex (own index query) | reuse
    kv_source: int | None
    index_source: int | None


def layer_roles(cfg) -> list[Role]:
    roles, kv, ix = [], None, None
    for layer in range(cfg.num_hidden_layers):
        ratio = cfg.compress_ratios[layer]
        if ratio == 0:
            roles.append(Role(0, "swa", None, None))
            continue
        if layer in cfg.kv_source_layer_ids:
            kv = ix = layer
            kind = "full"
        elif layer in cfg.index_source_layer_ids:
            ix, kind = layer, "reindex"
        else:
            kind = "reuse"
        roles.append(Role(ratio, kind, kv, ix))
    return roles


@dataclass
class Entries:
    """One KV source's global entries as the model reads them: main KV (FP4 values), index keys (MXFP4)."""

    main: torch.Tensor
    index: torch.Tensor

    def append(self, first: int, main: torch.Tensor, index: torch.Tensor) -> None:
        assert first == self.main.shape[0], f"entry {first} written after {self.main.shape[0]}"
        self.main, self.index = torch.cat((self.main, main)), torch.cat((self.index, index))


@dataclass
class Forward:
    W: Weights
    roles: list[Role]
    rows: dict[int, torch.Tensor]  # Engram layer -> table rows of every position
    stores: dict[int, Entries] = field(default_factory=dict)
    records: list[tuple[str, int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def cfg(self):
        return self.W.cfg

    def freqs(self, ratio: int) -> torch.Tensor:
        c = self.cfg  # ratio > 0: compressed-rope theta with YaRN; ratio 0: plain theta, no YaRN
        yarn = (c.original_seq_len, c.rope_factor, c.beta_fast, c.beta_slow) if ratio else None
        return rope_freqs(c.qk_rope_head_dim, c.compress_rope_theta if ratio else c.rope_theta, yarn)

    def write_entries(self, layer: int, ratio: int, h: torch.Tensor, pos: torch.Tensor) -> None:
        """The entries completed by tokens h at positions pos (§3.4): pooled latent, RoPE at j * ratio, FP4;
        index key from the pre-RoPE latent, RoPE, MXFP4."""
        W, eps, c = self.W, self.cfg.rms_norm_eps, f"layers.{layer}.attn.compressor."
        if ratio == 1:
            lat, first = W.linear(h, c + "wkv.weight"), int(pos[0])
        else:
            assert int(pos[0]) % 2 == 0, "a ratio-2 run must start on a group boundary"
            n = pos.numel() // 2
            kv = W.linear(h[: 2 * n], c + "wkv.weight").view(n, 2, -1)
            z = W.linear(h[: 2 * n], c + "wgate.weight").view(n, 2, -1)
            lat, first = (torch.softmax(z, dim=1) * kv).sum(1), int(pos[0]) // 2
        lat = rms_norm(lat, W[c + "norm.weight"], eps)
        epos = (torch.arange(lat.shape[0]) + first) * ratio
        ix = f"layers.{layer}.attn.indexer."
        k = rms_norm(W.linear(lat, ix + "wk.weight"), W[ix + "k_norm.weight"], eps)
        f = self.freqs(ratio)
        self.stores[layer].append(first, fp4_qdq(rope(lat, epos, f)), mxfp4_qdq(rope(k, epos, f)))

    def attn(self, layer, h, pos, start, slots, write_from) -> torch.Tensor:
        W, cfg, role = self.W, self.cfg, self.roles[layer]
        p, eps, t = f"layers.{layer}.attn.", cfg.rms_norm_eps, pos.numel()
        f = self.freqs(role.ratio)
        qr = rms_norm(W.fp8_linear(h, p + "wq_a.weight"), W[p + "q_norm.weight"], eps)
        q = rope(W.fp8_linear(qr, p + "wq_b.weight").view(t, cfg.num_attention_heads, -1), pos, f)
        kv = fp8_qdq(rope(rms_norm(W.fp8_linear(h, p + "wkv.weight"), W[p + "kv_norm.weight"], eps), pos, f))
        lo = (pos - cfg.sliding_window + 1).clamp(min=start)  # the window, truncated at the run start
        win = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= lo[:, None])
        gkv = gmask = None
        if role.ratio:
            if role.kind == "full" and write_from is not None and bool((pos >= write_from).any()):
                sel = pos >= write_from
                self.write_entries(layer, role.ratio, h[sel], pos[sel])
            store = self.stores[role.kv_source]
            n_vis = torch.div(pos + 1, role.ratio, rounding_mode="floor")
            e = int(n_vis.max())
            visible = torch.arange(e)[None, :] < n_vis[:, None]
            if role.kind in ("full", "reindex"):
                ih, idim = cfg.index_n_heads, cfg.index_head_dim
                iq = mxfp4_qdq(rope(W.fp8_linear(qr, p + "indexer.wq_b.weight").view(t, ih, idim), pos, f))
                iw = W.linear(h, p + "indexer.weights_proj.weight") * (idim**-0.5 * ih**-0.5)
                scores = torch.einsum("th,the->te", iw, torch.relu(torch.einsum("thd,ed->the", iq, store.index[:e])))
                allowed = visible
                if layer == cfg.candidate_source_layer_id:
                    slots["pool"] = candidate_mask(scores, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
                elif role.kind == "reindex":
                    allowed = visible & slots["pool"]
                slots[layer] = topk_mask(scores, allowed, cfg.index_topk)
            gkv, gmask = store.main[:e], slots[role.index_source]
        o = attention(q, kv, win, gkv, gmask, W[p + "attn_sink"], cfg.head_dim**-0.5)
        o = rope(o, pos, f, sign=-1.0).reshape(t, cfg.o_groups, -1)
        y = torch.einsum("tgd,grd->tgr", o, W[p + "wo_a.weight"].view(cfg.o_groups, -1, o.shape[-1]))
        return W.fp8_linear(y.reshape(t, -1), p + "wo_b.weight")

    def layer(self, layer, x, pre, pos, start, slots, write_from):
        W, cfg, p, eps = self.W, self.cfg, f"layers.{layer}.", self.cfg.rms_norm_eps
        if layer in self.rows:
            x = engram(W, x, self.rows[layer][pos], p + "engram.", eps)
        a_pre, a_post, a_comb = hc_mix(W, x, p + "hc_attn", cfg)
        h = rms_norm(collapse(x, pre), W[p + "attn_norm.weight"], eps)
        x = expand(self.attn(layer, h, pos, start, slots, write_from), x, a_post, a_comb)
        f_pre, f_post, f_comb = hc_mix(W, x, p + "hc_ffn", cfg)
        g = rms_norm(collapse(x, a_pre), W[p + "ffn_norm.weight"], eps)
        y = moe(W, g, p + "ffn.", cfg, cfg.n_routed_experts, cfg.num_experts_per_tok)
        return expand(y, x, f_post, f_comb), f_pre

    def run(self, part, x, pre, pos, layers, write_from):
        """One run over positions pos (consecutive): window truncated at pos[0]; fresh index slots."""
        slots: dict = {}
        for layer in layers:
            x, pre = self.layer(layer, x, pre, pos, int(pos[0]), slots, write_from)
            self.records.append((part, layer, int(pos[0]), x, pre))
        return x, pre


def forward(model, tokens: torch.Tensor, plan: tuple[list[Turn], int]) -> tuple[torch.Tensor, list]:
    """(logits [T - logits_from, V] with NaN rows where no decoder ran, per-layer records) of ``tokens``.

    Records are (part "encoder" | "decoder", layer, first position, streams [n, hc, D], pre [n, hc]) in run
    order. Reads ``model``'s state_dict, config and token map; mutates nothing of it.
    """
    W = Weights(model)
    cfg, tokens = W.cfg, tokens.cpu()
    turns, logits_from = plan
    total = tokens.numel()
    n_enc = next(i for i, r in enumerate(cfg.compress_ratios) if r == 1)
    fw = Forward(W, layer_roles(cfg), engram_rows(cfg, W.token_map, tokens))
    for src in cfg.kv_source_layer_ids:
        fw.stores[src] = Entries(torch.zeros(0, cfg.head_dim, dtype=torch.float64),
                                 torch.zeros(0, cfg.index_head_dim, dtype=torch.float64))
    hc, d = cfg.hc_mult, cfg.hidden_size
    enc_x = torch.zeros(total, hc, d, dtype=torch.float64)
    enc_pre = torch.zeros(total, hc, dtype=torch.float64)
    out = torch.full((total - logits_from, cfg.vocab_size), math.nan, dtype=torch.float64)
    for turn in turns:
        if turn.encoder_start is not None:
            s, r = turn.encoder_start, turn.cached_until
            for src, store in fw.stores.items():
                keep = r // cfg.compress_ratios[src]
                store.main, store.index = store.main[:keep], store.index[:keep]
            pos = torch.arange(s, turn.end)
            x = W["embed.weight"][tokens[s : turn.end]][:, None, :].expand(-1, hc, -1)
            pre = torch.nn.functional.one_hot(torch.zeros(pos.numel(), dtype=torch.long), hc).double()
            x, pre = fw.run("encoder", x, pre, pos, range(n_enc), r)
            enc_x[s : turn.end], enc_pre[s : turn.end] = x, pre
            new = pos >= r  # the decoder's entries: layer 20's ratio-1 compressor on its attention input
            h = rms_norm(collapse(x[new], pre[new]), W[f"layers.{n_enc}.attn_norm.weight"], cfg.rms_norm_eps)
            if h.shape[0]:
                fw.write_entries(n_enc, 1, h, pos[new])
        if turn.decoder_start is None:
            continue
        d0, e = turn.decoder_start, turn.end
        decoder = range(n_enc, cfg.num_hidden_layers)
        x, pre = fw.run("decoder", enc_x[d0:e], enc_pre[d0:e], torch.arange(d0, e), decoder, None)
        lo = max(d0, logits_from)
        if lo < e:
            last = rms_norm(collapse(x[lo - d0 :], pre[lo - d0 :]), W["norm.weight"], cfg.rms_norm_eps)
            out[lo - logits_from : e - logits_from] = W.linear(last, "head.weight")
    return out, fw.records
