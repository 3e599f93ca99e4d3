"""DSpark drafter stages (``mtp.0..2``): forward only; serving speculative decoding comes later.

Each stage is a full-width block with SWA-only attention (ratio 0) and a small MoE (model.md §3.8)::

    main_x  = main_norm(main_proj(cat(mean-stream block inputs of layers 37, 38, 39)))   [D]
    ring    : every stage keeps its own window of KV(main_x) of the real tokens, RoPE at their positions
    drafts  : rows [last token, noise x (block-1)] at positions pos+1 .. pos+block, embedded into 4 streams,
              attend to (ring window + all draft rows, no causal mask inside the block)
    logits  = head(norm(hc_pre(x, pre))) of the last stage;  out[0] = last token
    for i: me_i = markov.embed[out[i]];  logits[i] += markov.head(me_i);  out[i+1] = argmax(logits[i])
    confidence[i] = proj(cat(x_i, me_i))          (x_i = the last stage's normed collapse of row i)

Assumptions (not settled by public sources, see docs/model.md): the ring KV of a real token is the
stage's own ``attn.project_kv`` applied to ``attn_norm(main_x)``; ``main_proj``/``main_norm`` live in
stage 0, ``norm``/``markov_head``/``confidence_head`` in the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from flashtier.engine.model.attention import sparse_attention
from flashtier.engine.model.block import Block
from flashtier.engine.model.config import LayerRole, ModelConfig
from flashtier.engine.model.fp8_linear import linear
from flashtier.engine.model.mhc import hc_pre, identity_pre
from flashtier.engine.model.norm import RMSNorm
from flashtier.engine.model.numerics import up


class MarkovHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dspark_markov_rank, dtype=dtype)
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
    """Per-sequence drafter state: each stage's window of real-token KV (positions, values)."""

    kv: list[torch.Tensor] = field(default_factory=list)  # per stage [W, hd]
    pos: list[torch.Tensor] = field(default_factory=list)  # per stage [W] (-1 = empty)


@dataclass(frozen=True)
class DraftOutput:
    tokens: torch.Tensor  # [block] proposed ids (greedy)
    logits: torch.Tensor  # [block, V]
    confidence: torch.Tensor  # [block]


def new_rings(cfg: ModelConfig, n_stages: int, device: torch.device | None = None) -> DSparkRings:
    w = cfg.sliding_window
    return DSparkRings(
        [torch.zeros(w, cfg.head_dim, device=device) for _ in range(n_stages)],
        [torch.full((w,), -1, dtype=torch.long, device=device) for _ in range(n_stages)],
    )


def seed_rings(model, rings: DSparkRings, main_hidden: torch.Tensor, pos: torch.Tensor) -> None:
    """Write KV(main_x) of real tokens (main_hidden [T, n_src, D] at positions pos [T]) into every ring.

    Mutates ``rings``; only the newest ``window`` tokens are kept.
    """
    stages = model.mtp
    w = model.cfg.sliding_window
    # act quant: official DSparkBlock.forward_embed, self.main_proj(main_hidden) (fp8 Linear)
    main_x = stages[0].main_norm(linear(main_hidden.flatten(1), stages[0].main_proj))
    keep = slice(max(0, pos.numel() - w), pos.numel())
    for i, stage in enumerate(stages):
        kv = stage.attn.project_kv(stage.attn_norm(main_x[keep]), pos[keep])
        slots = pos[keep] % w
        rings.kv[i][slots] = kv
        rings.pos[i][slots] = pos[keep]


def dspark_propose(model, rings: DSparkRings, last_token: int, pos: int) -> DraftOutput:
    """Draft ``dspark_block_size`` tokens after ``last_token`` (sampled for position ``pos``).

    ``rings`` must already hold the real tokens up to ``pos - 1`` (``seed_rings``). Reads only.
    """
    cfg = model.cfg
    n = cfg.dspark_block_size
    dev = model.device
    ids = torch.full((n,), cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
    ids[0] = last_token
    x = model.embed_streams(ids)
    pre = identity_pre(n, cfg.hc_mult, dev)
    qpos = torch.arange(pos, pos + n, device=dev)
    for i, stage in enumerate(model.mtp):
        h, amix = stage.attn_input(x, pre)
        q, _ = stage.attn.project_q(h, qpos)
        own = stage.attn.project_kv(h, qpos)
        keys = torch.cat((rings.kv[i], own))
        kpos = torch.cat((rings.pos[i], qpos))
        ring_ok = (kpos >= 0) & (kpos > pos - cfg.sliding_window) & (kpos < pos)
        ring_ok = torch.cat((ring_ok[: rings.kv[i].shape[0]], torch.ones(n, dtype=torch.bool, device=dev)))
        mask = ring_ok[None, :].expand(n, -1)
        o = sparse_attention(q, keys, mask, None, None, stage.attn.attn_sink, stage.attn.scale)
        x, pre = stage.finish(stage.attn.output(o, qpos), x, amix)
    last = model.mtp[-1]
    xn = last.norm(hc_pre(x, pre))
    logits = F.linear(xn, up(model.head.weight))
    out = [last_token]
    conf = []
    mk = last.markov_head
    for i in range(n):
        me = up(mk.embed.weight[out[i]])
        logits[i] = logits[i] + F.linear(me, up(mk.head.weight))
        conf.append(F.linear(torch.cat((xn[i], me)), up(last.confidence_head.proj.weight)))
        out.append(int(torch.argmax(logits[i])))
    return DraftOutput(torch.tensor(out[1:], device=dev), logits, torch.cat(conf))
