"""The vocabulary split over the TP group: embedding lookup and output head.

Rank r holds rows ``[r * V / tp, (r + 1) * V / tp)`` of ``embed.weight`` and of ``head.weight``::

    embed_streams(ids)   each rank looks up the ids it holds (zero rows elsewhere), then an all-reduce
                         (sum): exactly one rank contributes each row, so the sum is the row itself
    logits(x, pre)       collapse + norm (replicated), the local head -> [T, V / tp], then an
                         all-gather along the vocabulary -> [T, V] on every rank

``VocabParallelTransformer`` is a ``Transformer`` whose class ``shard_vocab_`` switches in place (as
torch's ``fully_shard`` does); the forward paths call these two methods and are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from flashtier.engine.model.numerics import up
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.parallel.group_comm import GroupComm
from flashtier.engine.parallel.shard import Shard, even_shard


class VocabParallelTransformer(Transformer):
    vocab_comm: GroupComm
    vocab_shard: Shard

    def embed_streams(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> residual streams [T, hc, D] (fp32, or float64), equal on every rank of the group."""
        shard = self.vocab_shard
        local = ids - shard.start
        held = (local >= 0) & (local < shard.size)
        rows = up(self.embed.weight[local.clamp(0, shard.size - 1)])
        h = self.vocab_comm.all_reduce(torch.where(held[:, None], rows, torch.zeros_like(rows)))
        return h[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()

    def logits(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits [T, V] on every rank of the group."""
        return self.vocab_comm.all_gather(super().logits(x, pre), dim=-1)


@torch.no_grad()
def shard_vocab_(model: Transformer, comm: GroupComm) -> VocabParallelTransformer:
    """Keep rank ``comm.index``'s vocabulary rows of ``embed`` and ``head`` in place; switch the class.

    Mutates and returns ``model``. ValueError when already sharded or the group does not divide V.
    """
    if isinstance(model, VocabParallelTransformer):
        raise ValueError("model: the vocabulary is already sharded")
    v = model.cfg.vocab_size
    if v % comm.size:
        raise ValueError(f"--tensor-parallel-size {comm.size} does not divide the vocabulary of {v} tokens")
    shard = even_shard(v, comm.size, comm.index)
    model.embed.weight = nn.Parameter(model.embed.weight.detach()[shard.slice].clone(), requires_grad=False)
    model.embed.num_embeddings = shard.size
    model.head.weight = nn.Parameter(model.head.weight.detach()[shard.slice].clone(), requires_grad=False)
    model.head.out_features = shard.size
    model.__class__ = VocabParallelTransformer
    model.vocab_comm, model.vocab_shard = comm, shard
    return model
