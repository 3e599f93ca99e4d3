"""One backbone layer's parameters (``layers.L.*``) and its per-token pieces.

A block is two sub-layers with single-pass mHC: the ``pre`` (input-collapse) coefficients are produced
by one sub-layer and consumed by the next (model.md §3.2)::

    a = mixes_attn(x);  f = attn(attn_norm(hc_pre(x, pre_in)));  x = hc_post(f, x, a)
    b = mixes_ffn(x);   g = ffn(ffn_norm(hc_pre(x, a.pre)));      x = hc_post(g, x, b)
    return x, b.pre

The attention core (which keys a query sees) is supplied by ``layer_forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashtier.engine.model.attention import Attention
from flashtier.engine.model.config import LayerRole, ModelConfig
from flashtier.engine.model.engram import Engram
from flashtier.engine.model.mhc import HcMix, hc_mixes, hc_post, hc_pre
from flashtier.engine.model.moe import MoE
from flashtier.engine.model.norm import RMSNorm


@dataclass(frozen=True)
class AttnInputs:
    """What ``Block.enter`` gives: the streams after Engram, the attention input and mix, q and its RoPE'd
    part, and the raw KV entry."""

    x: torch.Tensor
    h: torch.Tensor
    amix: HcMix
    q: torch.Tensor
    qr: torch.Tensor
    kv_raw: torch.Tensor


class Block(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        role: LayerRole,
        dtype: torch.dtype,
        n_experts: int | None = None,
        top_k: int | None = None,
    ):
        super().__init__()
        hc, d = cfg.hc_mult, cfg.hidden_size
        n_mix = (2 + hc) * hc
        self.cfg, self.role = cfg, role
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, role, dtype)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, n_experts or cfg.n_routed_experts, top_k or cfg.num_experts_per_tok, dtype)
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn", nn.Parameter(torch.zeros(n_mix, hc * d)))
            self.register_parameter(f"hc_{sub}_base", nn.Parameter(torch.zeros(n_mix)))
            self.register_parameter(f"hc_{sub}_scale", nn.Parameter(torch.ones(3)))
        self.engram = Engram(cfg, role.index, dtype) if role.index in cfg.engram_layer_ids else None

    def _mix(self, x: torch.Tensor, sub: str) -> HcMix:
        cfg = self.cfg
        return hc_mixes(
            x,
            getattr(self, f"hc_{sub}_fn"),
            getattr(self, f"hc_{sub}_base"),
            getattr(self, f"hc_{sub}_scale"),
            norm_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
            sinkhorn_iters=cfg.hc_sinkhorn_iters,
        )

    def attn_input(self, x: torch.Tensor, pre_in: torch.Tensor) -> tuple[torch.Tensor, HcMix]:
        """The attention input h [T, D] (normed collapse of the streams) and this sub-layer's mix."""
        return self.attn_norm(hc_pre(x, pre_in)), self._mix(x, "attn")

    def enter(self, x: torch.Tensor, pre_in: torch.Tensor, grams: torch.Tensor | None, pos: torch.Tensor,
              capture: dict[int, torch.Tensor | None] | None = None, layer: int = -1) -> AttnInputs:
        """The layer's start, shared by the batched and the paged forwards: Engram (on its layers), DSpark's
        capture of the block input (``capture[layer]``: the stream mean, when ``layer`` is asked for), the
        attention input and mix, the query projections and the raw KV entry at positions ``pos``."""
        if self.engram is not None:
            x = self.engram(x, grams)
        if capture is not None and layer in capture:
            capture[layer] = x.mean(dim=1)
        h, amix = self.attn_input(x, pre_in)
        q, qr = self.attn.project_q(h, pos)
        return AttnInputs(x, h, amix, q, qr, self.attn.project_kv_raw(h, pos))

    def finish(self, f: torch.Tensor, x: torch.Tensor, amix: HcMix) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual update with the attention output f, then the FFN sub-layer -> (x, pre_out)."""
        x = hc_post(f, x, amix)
        fmix = self._mix(x, "ffn")
        g = self.ffn(self.ffn_norm(hc_pre(x, amix.pre)))
        return hc_post(g, x, fmix), fmix.pre
