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

``rank_slices`` reads back, from a sharded model (on "meta": planned before any load), which part of each
checkpoint tensor every parameter holds: what a rank reads by byte range (sharded_reader.py) instead of
building the whole model and cutting it.

Known gap: the DSpark drafter's ``dspark.head_logits`` reads ``model.head.weight`` directly, so with
a TP group larger than one it would see only this rank's vocabulary rows (drafting under TP needs
that function to go through the model).
"""

from __future__ import annotations

import torch

from flashtier.engine.model.sharded_reader import TensorSlice
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.parallel.expert_parallel_moe import ExpertParallelMoE
from flashtier.engine.parallel.parallel_attention import HeadShard, ParallelAttention, shard_attention_
from flashtier.engine.parallel.process_group import ParallelGroups
from flashtier.engine.parallel.sliced_expert import SlicedExpert
from flashtier.engine.parallel.tensor_parallel_moe import TensorParallelMoE
from flashtier.engine.parallel.vocab_parallel import VocabParallelTransformer, shard_vocab_


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


def rank_slices(model: Transformer) -> dict[str, TensorSlice]:
    """Checkpoint name -> the part of that tensor a parameter of the sharded ``model`` holds, for every
    parameter that holds a part (any other parameter holds its whole tensor; an expert another EP rank owns
    is absent from ``model``). Reads the shard records ``shard_model_`` left; the cuts are its own:

        embed / head        rows vocab_shard                           (vocab_parallel.shard_vocab_)
        attn.wq_b           rows heads x head_dim; attn_sink: heads    (parallel_attention.shard_attention_)
        attn.wo_a / wo_b    rows / columns groups x o_lora_rank
        SlicedExpert        w1, w3 rows inter; w2 columns inter        (SlicedExpert.from_expert)
    """
    out: dict[str, TensorSlice] = {}
    if isinstance(model, VocabParallelTransformer):
        vocab = model.vocab_shard
        for name in ("embed.weight", "head.weight"):
            out[name] = TensorSlice(0, vocab.start, vocab.size)
    for name, module in model.named_modules():
        if isinstance(module, ParallelAttention):
            hs, hd = module.head_shard, module.head_dim
            rank_out = module.wo_a.weight.shape[0] // module.groups  # o_lora_rank (wo_a holds whole groups)
            groups = TensorSlice(0, hs.group_start * rank_out, hs.groups * rank_out)
            out[f"{name}.wq_b.weight"] = TensorSlice(0, hs.head_start * hd, hs.heads * hd)
            out[f"{name}.attn_sink"] = TensorSlice(0, hs.head_start, hs.heads)
            out[f"{name}.wo_a.weight"] = groups
            out[f"{name}.wo_b.weight"] = TensorSlice(1, groups.start, groups.size)
        elif isinstance(module, SlicedExpert):
            out.update(module.checkpoint_slices(name))
    return out
