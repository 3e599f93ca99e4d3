"""Shard a built ``Transformer`` in place for one rank: the one entry point of the split.

    attention (backbone + DSpark stages)   heads over the TP group       parallel_attention.py
    embedding, output head                 vocabulary over the TP group  vocab_parallel.py
    MoE, expert_parallel                   experts over the EP group     expert_parallel_moe.py
    MoE, otherwise                         expert width over the TP group tensor_parallel_moe.py
    mHC, norms, Engram, gate, compressor, indexer, DSpark heads       replicated (untouched)

The forward code is the single-process code: the sharded modules keep its interfaces
(``Attention.output``, ``Block.ffn``, ``Transformer.embed_streams`` / ``logits``) and run their
collectives inside. Every rank of the run must shard the same model with its own ``ParallelGroups`` and
then make the same sequence of forward calls (a DP replica without tokens included).

Known gap: the DSpark drafter's ``dspark.head_logits`` reads ``model.head.weight`` directly, so with
a TP group larger than one it would see only this rank's vocabulary rows (drafting under TP needs
that function to go through the model).
"""

from __future__ import annotations

import torch

from flashtier.engine.model.transformer import Transformer
from flashtier.engine.parallel.expert_parallel_moe import ExpertParallelMoE
from flashtier.engine.parallel.parallel_attention import HeadShard, shard_attention_
from flashtier.engine.parallel.process_group import ParallelGroups
from flashtier.engine.parallel.tensor_parallel_moe import TensorParallelMoE
from flashtier.engine.parallel.vocab_parallel import shard_vocab_


@torch.no_grad()
def shard_model_(model: Transformer, groups: ParallelGroups) -> Transformer:
    """Keep only this rank's part of ``model`` (float weights, before ``placement.quantize_linears_`` /
    ``moe_convert``; on the "meta" device too, to plan a sharded load) and insert the collectives.

    Mutates and returns ``model`` (and records ``groups`` as ``model.parallel_groups``); with TP 1 and no
    expert parallelism no module changes. ValueError (naming the setting) when the split does not fit the
    model's geometry, the model is already sharded or its weights are already converted.
    """
    cfg, config = model.cfg, groups.config
    config.validate_for(cfg, with_dspark=len(model.mtp) > 0)
    if getattr(model, "parallel_groups", None) is not None:
        raise ValueError("model: already sharded")
    tp, ep = groups.tp, groups.ep
    blocks = [*model.layers, *model.mtp]
    if tp.size > 1:
        shard = HeadShard.of_rank(cfg, tp.index, tp.size)
        for block in blocks:
            shard_attention_(block.attn, tp, shard)
        model = shard_vocab_(model, tp)
    for block in blocks:
        if config.expert_parallel:
            block.ffn = ExpertParallelMoE(block.ffn, tp, ep)
        elif tp.size > 1:
            block.ffn = TensorParallelMoE(block.ffn, tp)
    model.parallel_groups = groups
    return model
