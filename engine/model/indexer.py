"""The sparse indexer: which global entries each query attends to (model.md §3.5).

    k      = k_norm(wk(latent))        PRE-RoPE latent of a KV-source entry; RoPE at j*ratio; MXFP4
    q      = wq_b(qr).view(IH, ID)     RoPE at the token position; MXFP4
    w      = weights_proj(x) * ID^-0.5 * IH^-0.5
    score  = sum_h w_h * relu(q_h . k)          entry j visible to query i iff j < (i+1)//ratio
    top-k  = the min(index_topk, visible) best visible entries, ascending, -1 padded

Ties are broken towards the lower entry index (a stable sort), so every path selects the same set.
Layer 20 also builds the candidate pool (``candidate_pool``) that Reindex layers score inside.
"""

from __future__ import annotations

import torch
from torch import nn

from flashtier.engine.model.config import ModelConfig
from flashtier.engine.model.fp8_linear import linear
from flashtier.engine.model.norm import RMSNorm
from flashtier.engine.model.numerics import linear_up, qdq, up
from flashtier.engine.model.rope import make_rope
from flashtier.kernels.quant.mxfp4 import mxfp4_qdq


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, is_kv_source: bool, dtype: torch.dtype):
        super().__init__()
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        self.n_heads, self.head_dim = ih, idim
        self.wq_b = nn.Linear(cfg.q_lora_rank, ih * idim, bias=False, dtype=dtype)
        self.weights_proj = nn.Linear(cfg.hidden_size, ih, bias=False, dtype=dtype)
        if is_kv_source:
            self.wk = nn.Linear(cfg.head_dim, idim, bias=False, dtype=dtype)
            self.k_norm = RMSNorm(idim, cfg.rms_norm_eps)
        else:
            self.wk = None
            self.k_norm = None
        self.rope = make_rope(cfg, yarn=True)
        self.weight_scale = idim**-0.5 * ih**-0.5

    def project_q(
        self, qr: torch.Tensor, h: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries q [T, IH, ID] (RoPE + MXFP4 qdq) and head weights w [T, IH]."""
        # act quant: official Indexer.forward, self.wq_b(qr) (fp8 ColumnParallelLinear); weights_proj is bf16: none
        q = linear(qr, self.wq_b).view(qr.shape[0], self.n_heads, self.head_dim)
        q = qdq(mxfp4_qdq, self.rope.apply(q, pos))
        ww = self.weights_proj.weight
        w = up(linear_up(h.to(ww.dtype), ww)) * self.weight_scale
        return q, w

    def project_k_raw(self, latent: torch.Tensor, entry_pos: torch.Tensor) -> torch.Tensor:
        """Index keys [E, ID] before MXFP4: from PRE-RoPE latents [E, hd], rotated at their positions."""
        assert self.wk is not None, "only KV-source layers own an index key projection"
        wk = self.wk.weight
        k = self.k_norm(up(linear_up(latent.to(wk.dtype), wk)))
        return self.rope.apply(k, entry_pos)

    def project_k(self, latent: torch.Tensor, entry_pos: torch.Tensor) -> torch.Tensor:
        """Index keys [E, ID] as the model sees them (MXFP4 quantise-dequantise)."""
        return qdq(mxfp4_qdq, self.project_k_raw(latent, entry_pos))


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e]) -> [T, E] fp32."""
    return torch.einsum("the,th->te", torch.relu(torch.einsum("thd,ed->the", q, k)), w)


def _stable_desc_order(scores: torch.Tensor) -> torch.Tensor:
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def select_topk(
    scores: torch.Tensor, visible: torch.Tensor, topk: int, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """Top-k entry indices [T, min(topk, E)] among visible (and allowed) entries, ascending, -1 padded.

    ``visible`` [T] is the number of visible entries per query; ``allowed`` [T, E] restricts the
    choice (the candidate pool of a Reindex layer). Entries outside the mask are never selected.
    """
    t, e = scores.shape
    k = min(topk, e)
    if k == 0:
        return torch.full((t, 0), -1, dtype=torch.long, device=scores.device)
    valid = torch.arange(e, device=scores.device)[None, :] < visible[:, None]
    if allowed is not None:
        valid = valid & allowed
    s = scores.masked_fill(~valid, float("-inf"))
    order = _stable_desc_order(s)[:, :k]
    chosen = torch.gather(valid, 1, order)
    idx = torch.where(chosen, order, torch.full_like(order, e))
    idx = torch.sort(idx, dim=-1).values
    return torch.where(idx >= e, torch.full_like(idx, -1), idx)


def candidate_pool(scores: torch.Tensor, visible: torch.Tensor, block: int, n_blocks: int) -> torch.Tensor:
    """Layer 20's candidate pool: mask [T, E] of entries in each query's kept blocks.

    Block score = max of the block's visible entry scores; the block holding the newest visible
    entry is always kept (+inf); then the ``n_blocks`` best blocks with a finite score are kept.
    """
    t, e = scores.shape
    nb = -(-e // block)
    col = torch.arange(nb * block, device=scores.device)
    vis = col[None, :] < visible[:, None]
    s = torch.full((t, nb * block), float("-inf"), device=scores.device)
    s[:, :e] = scores
    s = s.masked_fill(~vis, float("-inf"))
    bs = s.view(t, nb, block).amax(-1)
    has = visible > 0
    newest = ((visible - 1).clamp(min=0) // block).long()
    rows = torch.arange(t, device=scores.device)
    bs[rows[has], newest[has]] = float("inf")
    order = _stable_desc_order(bs)[:, :n_blocks]
    kept_blocks = torch.zeros(t, nb, dtype=torch.bool, device=scores.device)
    kept_blocks.scatter_(1, order, torch.gather(bs, 1, order) > float("-inf"))
    allowed = kept_blocks.repeat_interleave(block, dim=1)[:, :e]
    return allowed & vis[:, :e]
