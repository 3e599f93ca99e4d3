"""DSpark drafter stages (``mtp.0..2``) and their forward, as the official V4.1 ``DSparkBlock`` runs them.

Each stage is a full-width block with SWA-only attention (ratio 0) and a small MoE (model.md §3.8)::

    main_hidden : per real position, the block INPUT of layers 37, 38, 39 (mean over the hc streams), concatenated
    main_x      = main_norm(main_proj(main_hidden))                                       (mtp.0)
    ring        : each stage keeps a window of real-position KV: kv_norm(wkv(main_x)), RoPE at the position,
                  FP8 quantise-dequantise (``attn.project_kv(main_x)``; no attn_norm on main_x)
    draft rows  : [t, noise x (block-1)] at positions p .. p+block-1, t = the token sampled for position p;
                  embedded into 4 streams, pre = one-hot; every stage's attention sees the ring positions
                  [p - W, p - 1] plus all draft rows (no causal mask inside the block); the stages chain (x, pre)
    x           = hc_pre(x, pre) of the last stage (un-normed);  logits = head(norm(x))  (shared fp32 head)
    Markov      : for i: (bias_i, me_i) = markov_head(out[i]); logits[i] += bias_i; out[i+1] = sample(logits[i])
    confidence  : confidence_head.proj(cat(x_i, me_i)) in fp32: the score that draft out[i+1] is accepted

Official source: ``inference/model.py`` of V4.1 (``Transformer.forward`` collects ``h.mean(dim=2)`` before
blocks 37-39; ``DSparkAttention.forward`` seeds ``window_kv_cache[start_pos % win]`` with the real token's
KV and attends to ``arange(min(win, start_pos + 1))`` ring slots plus the block; ``forward_head`` feeds the
un-normed collapse to the confidence head). The sampling loop itself lives in the engine (spec/drafter.py):
it needs each request's temperature and generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashtier.engine.model.block import Block
from flashtier.engine.model.config import LayerRole, ModelConfig
from flashtier.engine.model.embedding import embedding
from flashtier.engine.model.fp8_linear import linear
from flashtier.engine.model.mhc import hc_pre, identity_pre

# The drafter's tensors in the official checkpoint layout (``mtp.0.main_proj.weight``, ...).
DSPARK_PREFIX = "mtp."


def dspark_skip(with_dspark: bool) -> tuple[str, ...]:
    """The checkpoint prefixes a loader leaves unread: the drafter's when speculation is off."""
    return () if with_dspark else (DSPARK_PREFIX,)
from flashtier.engine.model.norm import RMSNorm
from flashtier.engine.model.numerics import linear_up, up


class MarkovHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed = embedding(cfg.vocab_size, cfg.dspark_markov_rank, dtype)
        self.head = nn.Linear(cfg.dspark_markov_rank, cfg.vocab_size, bias=False, dtype=dtype)


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size + cfg.dspark_markov_rank, 1, bias=False, dtype=torch.float32)


class DSparkStage(Block):
    def __init__(self, cfg: ModelConfig, stage: int, n_stages: int, dtype: torch.dtype):
        role = LayerRole(cfg.num_hidden_layers + stage, "drafter", "swa", 0, None, None)
        super().__init__(cfg, role, dtype, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)
        d = cfg.hidden_size
        n_src = len(cfg.dspark_target_layer_ids)
        if stage == 0:
            self.main_proj = nn.Linear(n_src * d, d, bias=False, dtype=dtype)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if stage == n_stages - 1:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg, dtype)
            self.confidence_head = ConfidenceHead(cfg)


@dataclass
class DSparkRings:
    """One sequence's drafter windows: every stage's KV of real positions (slot = position % W)."""

    kv: torch.Tensor  # [stages, W, hd] (FP8-dequantised values)
    pos: torch.Tensor  # [stages, W] position held by each slot (-1 = empty)

    def clone(self) -> DSparkRings:
        return DSparkRings(self.kv.clone(), self.pos.clone())

    @property
    def newest(self) -> int:
        """The newest position held (-1 when empty)."""
        return int(self.pos.max())


@dataclass(frozen=True)
class DraftOutput:
    tokens: torch.Tensor  # [block] proposed ids (greedy)
    logits: torch.Tensor  # [block, V] (Markov bias included)
    confidence: torch.Tensor  # [block]


def new_rings(cfg: ModelConfig, n_stages: int, device: torch.device | None = None,
              dtype: torch.dtype = torch.float32) -> DSparkRings:
    w = cfg.sliding_window
    return DSparkRings(torch.zeros(n_stages, w, cfg.head_dim, device=device, dtype=dtype),
                       torch.full((n_stages, w), -1, dtype=torch.long, device=device))


def ring_kv(model, main_hidden: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Every stage's ring KV of real positions ``pos`` [T] from their draft inputs ``main_hidden`` [T, n_src, D].

    Returns [stages, T, hd]. Reads only."""
    stages = model.mtp
    # act quant: official DSparkBlock.forward_embed, self.main_proj(main_hidden) (fp8 Linear)
    main_x = stages[0].main_norm(linear(main_hidden.flatten(1), stages[0].main_proj))
    # official DSparkAttention.forward: kv_norm(wkv(main_x)), RoPE at the position, act_quant (FP8 qdq)
    return torch.stack([stage.attn.project_kv(main_x, pos) for stage in stages])


def write_rings(rings: DSparkRings, kv: torch.Tensor, pos: torch.Tensor) -> None:
    """Store ``kv`` [stages, T, hd] of consecutive positions ``pos`` [T]; only the newest W are kept.

    Mutates ``rings``."""
    w = rings.pos.shape[1]
    kv, pos = kv[:, -w:], pos[-w:]
    slots = pos % w
    rings.kv[:, slots] = kv.to(rings.kv.dtype)
    rings.pos[:, slots] = pos


def seed_rings(model, rings: DSparkRings, main_hidden: torch.Tensor, pos: torch.Tensor) -> None:
    """Write the ring KV of real positions ``pos`` [T] (draft inputs ``main_hidden`` [T, n_src, D]) into every
    stage's window. Mutates ``rings``; only the newest ``window`` positions are kept."""
    write_rings(rings, ring_kv(model, main_hidden, pos), pos)


def _attend_block(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """q [B, n, H, hd] over keys [B, K, hd] (K = V) visible where ``mask`` [B, K], plus the per-head sink.

    The same softmax as ``attention.sparse_attention``, batched over sequences. Returns [B, n, H, hd]."""
    q = up(q)
    kv = up(keys)
    s = torch.einsum("bnhd,bkd->bnhk", q, kv) * scale
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    sink_b = up(sink)[None, None, :, None].expand(*s.shape[:3], 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink_b)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink_b - m)
    return torch.einsum("bnhk,bkd->bnhd", p, kv) / denom


@torch.no_grad()
def draft_block(model, rings: Sequence[DSparkRings], last_tokens: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """The stages over B sequences' draft rows: ``last_tokens`` [B] sampled for ``positions`` [B].

    Each ring must hold its sequence's real positions up to ``positions[b] - 1``. Returns the last stage's
    un-normed collapse x [B, block, D] (the head and the Markov/confidence heads read it). Reads only."""
    return draft_rows(model, torch.stack([r.kv for r in rings], dim=1), torch.stack([r.pos for r in rings], dim=1),
                      last_tokens, positions)


@torch.no_grad()
def draft_rows(model, ring_kv_all: torch.Tensor, ring_pos: torch.Tensor, last_tokens: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """``draft_block`` over the rings already stacked: ``ring_kv_all`` [stages, B, W, hd], ``ring_pos``
    [stages, B, W] (-1: an empty slot). Fixed shapes for a given B (spec/draft_graphs.py captures it). Reads
    only."""
    cfg = model.cfg
    n, w = cfg.dspark_block_size, cfg.sliding_window
    b = last_tokens.numel()
    dev = model.device
    ids = torch.full((b, n), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
    ids[:, 0] = last_tokens
    x = model.embed_streams(ids.flatten())
    pre = identity_pre(b * n, cfg.hc_mult, dev, model.compute_dtype)
    qpos = (positions[:, None] + torch.arange(n, device=dev)[None, :]).flatten()
    p0 = positions[:, None]
    ring_ok = (ring_pos >= 0) & (ring_pos >= p0 - w) & (ring_pos < p0)  # [stages, B, W]
    own_ok = torch.ones(b, n, dtype=torch.bool, device=dev)
    for i, stage in enumerate(model.mtp):
        h, amix = stage.attn_input(x, pre)
        q, _ = stage.attn.project_q(h, qpos)
        own = stage.attn.project_kv(h, qpos).view(b, n, -1)
        keys = torch.cat((ring_kv_all[i].to(own.dtype), own), dim=1)
        mask = torch.cat((ring_ok[i], own_ok), dim=1)
        o = _attend_block(q.view(b, n, *q.shape[1:]), keys, mask, stage.attn.attn_sink, stage.attn.scale)
        x, pre = stage.finish(stage.attn.output(o.flatten(0, 1), qpos), x, amix)
    return hc_pre(x, pre).view(b, n, -1)


def head_logits(model, x: torch.Tensor) -> torch.Tensor:
    """Draft logits before the Markov bias: the last stage's norm, then the backbone's fp32 head. x [..., D].

    ``linear_up`` as the backbone's logits: the bf16 weight read as stored (an fp32 copy of the head would be
    written and read again at every draft position) and each row's bits independent of the batch."""
    return linear_up(up(model.mtp[-1].norm(x)), model.head.weight)


def markov(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Markov head of the previous tokens [B]: (logit bias [B, V], embedding [B, rank])."""
    mk = model.mtp[-1].markov_head
    me = up(mk.embed.weight[tokens])
    return linear_up(me, mk.head.weight), me


def confidence(model, x: torch.Tensor, me: torch.Tensor) -> torch.Tensor:
    """Acceptance scores [B] of the drafts read from rows x [B, D] (un-normed) with Markov embeddings me."""
    w = model.mtp[-1].confidence_head.proj.weight
    return F.linear(torch.cat((x, me), dim=-1).float(), w.float())[:, 0]


def dspark_propose(model, rings: DSparkRings, last_token: int, pos: int) -> DraftOutput:
    """Greedy drafts (official ``forward_head`` at temperature 0) after ``last_token`` sampled for ``pos``.

    ``rings`` must already hold the real positions up to ``pos - 1`` (``seed_rings``). Reads only."""
    dev = model.device
    x = draft_block(model, [rings], torch.tensor([last_token], device=dev), torch.tensor([pos], device=dev))[0]
    logits = head_logits(model, x)
    out, conf = [last_token], []
    for i in range(x.shape[0]):
        bias, me = markov(model, torch.tensor([out[i]], device=dev))
        logits[i] = logits[i] + bias[0]
        conf.append(confidence(model, x[i : i + 1], me))
        out.append(int(torch.argmax(logits[i])))
    return DraftOutput(torch.tensor(out[1:], device=dev), logits, torch.cat(conf))
