"""Tensor-parallel attention: the heads split over the TP group, the output projection row-parallel.

Per layer (model.md §3.3), what each rank of a TP group of size tp holds::

    wq_a, q_norm            replicated   qr is one 1280-wide vector per token, read by every head AND by
                                         the indexer: splitting it would need an all-gather first
    wq_b, attn_sink         heads [r*H/tp, (r+1)*H/tp)      column-parallel: a head's query is its own rows
    wkv, kv_norm            replicated   MQA: ONE 512-dim latent per token is K and V of every head, so
                                         every rank needs all of it; it is 1/64 of the query width
    compressor, indexer     replicated   they build that shared latent's global entries and one top-k per
                                         token for all heads (the indexer's score sums its 32 heads before
                                         the top-k: splitting them would add an all-reduce of [T, entries]
                                         scores per layer for a projection of 1/8 the query's size)
    wo_a                    groups [r*G/tp, (r+1)*G/tp)     group g reads only heads of group g (contiguous
                                         heads), so a rank whose heads are whole groups owns those groups
    wo_b                    columns of its groups           row-parallel: partial sums over the groups
    ONE all-reduce (sum) of wo_b's output per attention block

Exact: the split never cuts a dot product except wo_b's (summed by the all-reduce), and wo_b's FP8
activation blocks (32) fall inside a group (o_lora_rank is a multiple of 32, ParallelConfig checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashtier.engine.model.attention import Attention
from flashtier.engine.model.config import ModelConfig
from flashtier.engine.parallel.group_comm import GroupComm


@dataclass(frozen=True)
class HeadShard:
    """The heads and output groups one TP rank holds (heads of a group are consecutive)."""

    head_start: int
    heads: int
    group_start: int
    groups: int

    @staticmethod
    def of_rank(cfg: ModelConfig, tp_rank: int, tp_size: int) -> "HeadShard":
        """Rank ``tp_rank``'s whole output groups. ValueError when tp_size does not divide o_groups."""
        if cfg.o_groups % tp_size or not 0 <= tp_rank < tp_size:
            raise ValueError(f"--tensor-parallel-size {tp_size} does not divide the {cfg.o_groups} output groups")
        groups = cfg.o_groups // tp_size
        per_group = cfg.num_attention_heads // cfg.o_groups
        return HeadShard(tp_rank * groups * per_group, groups * per_group, tp_rank * groups, groups)


class ParallelAttention(Attention):
    """An ``Attention`` holding a ``HeadShard``; its output ends with the TP all-reduce.

    Made by ``shard_attention_`` (which switches an existing module's class, as torch's ``fully_shard``
    does), never constructed directly. ``n_heads`` / ``groups`` are the local counts.
    """

    tp_comm: GroupComm
    head_shard: HeadShard

    def output(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """o [T, H_local, hd] -> the whole attention output [T, D] (sum over the TP group)."""
        return self.tp_comm.all_reduce(super().output(o, pos))


def _keep_rows(layer: nn.Linear, rows: slice) -> None:
    layer.weight = nn.Parameter(layer.weight.detach()[rows].clone(), requires_grad=False)
    layer.out_features = layer.weight.shape[0]


def _keep_cols(layer: nn.Linear, cols: slice) -> None:
    layer.weight = nn.Parameter(layer.weight.detach()[:, cols].clone(), requires_grad=False)
    layer.in_features = layer.weight.shape[1]


@torch.no_grad()
def shard_attention_(attn: Attention, comm: GroupComm, shard: HeadShard) -> ParallelAttention:
    """Keep only ``shard``'s heads and groups of ``attn`` in place and make it a ``ParallelAttention``.

    Mutates ``attn`` (its class, wq_b, attn_sink, wo_a, wo_b, n_heads, groups) and returns it. ValueError
    when ``attn`` is already sharded, holds FP8 weights (shard before ``placement.quantize_linears_``),
    or ``shard`` does not fit its geometry.
    """
    if isinstance(attn, ParallelAttention):
        raise ValueError("attn: this attention is already sharded")
    for name in ("wq_b", "wo_a", "wo_b"):
        if type(getattr(attn, name)) is not nn.Linear:
            raise ValueError(f"attn.{name}: shard the model before quantising its linears (quantize_linears_)")
    h, g, hd = attn.n_heads, attn.groups, attn.head_dim
    per_group = h // g
    if (shard.groups < 1 or shard.group_start + shard.groups > g or shard.heads != shard.groups * per_group
            or shard.head_start != shard.group_start * per_group):
        raise ValueError(f"shard {shard} is not a run of whole output groups of {h} heads in {g} groups")
    rank_out = attn.wo_a.weight.shape[0] // g  # o_lora_rank
    heads, groups = slice(shard.head_start, shard.head_start + shard.heads), slice(
        shard.group_start, shard.group_start + shard.groups)
    _keep_rows(attn.wq_b, slice(heads.start * hd, heads.stop * hd))
    attn.attn_sink = nn.Parameter(attn.attn_sink.detach()[heads].clone(), requires_grad=False)
    _keep_rows(attn.wo_a, slice(groups.start * rank_out, groups.stop * rank_out))
    _keep_cols(attn.wo_b, slice(groups.start * rank_out, groups.stop * rank_out))
    attn.n_heads, attn.groups = shard.heads, shard.groups
    attn.__class__ = ParallelAttention
    attn.tp_comm, attn.head_shard = comm, shard
    return attn
