"""Attention of one layer: q LoRA, shared 512-latent K = V (MQA), partial RoPE, sink, grouped output.

Parameter names follow the official checkpoint (``layers.L.attn.*``, model.md §4). This module owns
the per-token projections; which keys a query sees (window ring, selected global entries) is
assembled by the caller (the reference pass or the incremental path) and handed to
``sparse_attention``.
"""

from __future__ import annotations

import torch
from torch import nn

from flashtier.engine.model.compressor import Compressor
from flashtier.engine.model.config import LayerRole, ModelConfig
from flashtier.engine.model.fp8_linear import grouped_linear, linear
from flashtier.engine.model.indexer import Indexer
from flashtier.engine.model.norm import RMSNorm
from flashtier.engine.model.numerics import qdq, up
from flashtier.engine.model.rope import make_rope
from flashtier.kernels.quant.fp8 import fp8_qdq


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, role: LayerRole, dtype: torch.dtype):
        super().__init__()
        d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        g = cfg.o_groups
        self.cfg, self.role = cfg, role
        self.n_heads, self.head_dim, self.groups = h, hd, g
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * hd, bias=False, dtype=dtype)
        self.wkv = nn.Linear(d, hd, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(h * hd // g, g * cfg.o_lora_rank, bias=False, dtype=dtype)
        self.wo_b = nn.Linear(g * cfg.o_lora_rank, d, bias=False, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.compressor = Compressor(cfg, role.ratio, dtype) if role.role == "full" else None
        self.indexer = (
            Indexer(cfg, is_kv_source=role.role == "full", dtype=dtype)
            if role.role in ("full", "reindex")
            else None
        )
        # compressed layers rotate everything with the YaRN tables (model.md §3.9)
        self.rope = make_rope(cfg, yarn=role.ratio > 0)
        self.scale = hd**-0.5

    def project_q(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [T, H, hd] (RoPE applied) and the shared LoRA activation qr [T, q_lora]."""
        qr = self.q_norm(linear(h, self.wq_a))  # act quant: official Attention.forward, self.wq_a(x) (fp8 Linear)
        q = linear(qr, self.wq_b).view(h.shape[0], self.n_heads, self.head_dim)  # act quant: self.wq_b(qr)
        return self.rope.apply(q, pos), qr

    def project_kv_raw(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Window KV [T, hd] before quantisation: normed latent, RoPE on the last channels.

        Caches store ``quantize_fp8`` of this; the values every reader sees are ``project_kv``.
        """
        # act quant: official Attention._window_kv, self.wkv(x) (fp8 Linear)
        return self.rope.apply(self.kv_norm(linear(h, self.wkv)), pos)

    def project_kv(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Window KV [T, hd] as the model sees it: FP8 quantise-dequantise of ``project_kv_raw``."""
        return qdq(fp8_qdq, self.project_kv_raw(h, pos))

    def output(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Undo the query rotation on o [T, H, hd], grouped low-rank wo_a, then wo_b -> [T, D]."""
        t = o.shape[0]
        o = self.rope.apply(o, pos, inverse=True).reshape(t, self.groups, -1)
        # NO act quant: official Attention.forward runs wo_a as a bf16 einsum (convert.py dequantises it)
        y = grouped_linear(o, self.wo_a, self.groups)
        return linear(y.reshape(t, -1), self.wo_b)  # act quant: official self.wo_b(o.flatten(2)) (fp8 Linear)


def sparse_attention(
    q: torch.Tensor,
    local_kv: torch.Tensor,
    local_mask: torch.Tensor,
    global_kv: torch.Tensor | None,
    global_mask: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One softmax over (window keys + selected global entries) plus a per-head sink; K = V.

    q [T, H, D]; local_kv [K, D] shared by all queries with local_mask [T, K]; global_kv [T, S, D]
    per query with global_mask [T, S]. Per (token, head)::

        o = sum_t e^(s_t - m) KV_t / (sum_t e^(s_t - m) + e^(sink - m)),  s_t = scale * q . KV_t

    Returns o [T, H, D] fp32. A query with no visible key returns 0 (all mass on the sink).

    On the CPU a long run of queries (a prefill chunk: local_kv holds the whole chunk, each query sees a
    window of it) goes in blocks of ``QUERY_BLOCK`` queries, each against the span of local keys its mask
    reaches: the dense [T, K] scores of a 1024-token chunk are ~65x the window's work, and were three
    quarters of the CPU engine's prefill time. The keys left out are masked for every query of the block, so
    the result is the same softmax (their exp is exactly 0). Not on CUDA: the span needs the mask on the host.
    """
    sink = up(sink)
    outs = []
    for (i0, i1), (c0, c1) in _query_blocks(local_mask, q.is_cuda):
        qb, kv_loc, kv_glob = up(q[i0:i1]), up(local_kv[c0:c1]), None if global_kv is None else up(global_kv[i0:i1])
        s_loc = torch.einsum("thd,kd->thk", qb, kv_loc) * scale
        parts = [s_loc.masked_fill(~local_mask[i0:i1, None, c0:c1], float("-inf"))]
        if kv_glob is not None:
            s_glob = torch.einsum("thd,tsd->ths", qb, kv_glob) * scale
            parts.append(s_glob.masked_fill(~global_mask[i0:i1, None, :], float("-inf")))
        s = torch.cat(parts, dim=-1)
        sink_b = sink[None, :, None].expand(s.shape[0], -1, 1)
        m = torch.maximum(s.amax(-1, keepdim=True), sink_b)
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True) + torch.exp(sink_b - m)
        o = torch.einsum("thk,kd->thd", p[..., : c1 - c0], kv_loc)
        if kv_glob is not None:
            o = o + torch.einsum("ths,tsd->thd", p[..., c1 - c0 :], kv_glob)
        outs.append(o / denom)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


QUERY_BLOCK = 64  # queries per block of a long CPU run (sparse_attention)


def _query_blocks(local_mask: torch.Tensor, on_cuda: bool) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(query rows [i0, i1), local key columns [c0, c1)) to attend in turn: every query against every key, or
    on the CPU, for a long run, blocks of ``QUERY_BLOCK`` queries against the span their masks reach."""
    t, k_loc = local_mask.shape
    if t <= QUERY_BLOCK or k_loc <= 2 * QUERY_BLOCK or on_cuda:
        return [((0, t), (0, k_loc))]
    cols = torch.arange(k_loc, device=local_mask.device)
    blocks = []
    for i0 in range(0, t, QUERY_BLOCK):
        i1 = min(i0 + QUERY_BLOCK, t)
        hit = cols[local_mask[i0:i1].any(0)]
        blocks.append(((i0, i1), (int(hit[0]), int(hit[-1]) + 1) if hit.numel() else (0, 0)))
    return blocks
