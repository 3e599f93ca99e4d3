"""The split's bookkeeping without processes: ParallelConfig checks, shards, head shards, and the FP8
quantisation of a column slice (column_quant.py), whose amax exchange runs here between threads."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.parallel import GroupComm, ParallelConfig, ParallelGroups, shard_model_
from flashtier.engine.parallel.column_quant import column_shard_qdq
from flashtier.engine.parallel.parallel_attention import HeadShard, shard_attention_
from flashtier.engine.parallel.shard import Shard, even_shard
from flashtier.kernels.quant.fp8 import fp8_qdq


@pytest.mark.parametrize(
    ("fields", "model", "message"),
    [
        ({"tensor_parallel_size": 3}, "v4.1-flash", "--tensor-parallel-size 3 does not divide the 64 attention heads"),
        ({"tensor_parallel_size": 16}, "v4.1-flash", "does not divide the 8 output groups"),
        ({"tensor_parallel_size": 4}, "tiny", "--tensor-parallel-size 4 does not divide the 2 output groups"),
        ({"data_parallel_size": 3, "expert_parallel": True}, "tiny",
         "= 3 expert-parallel ranks do not divide the 8 routed experts"),
        ({"tensor_parallel_size": 5, "expert_parallel": True}, "v4.1-flash", "does not divide the 64 attention heads"),
    ],
)
def test_config_names_the_setting_that_does_not_fit(fields, model, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields).validate_for(preset(model))


def test_config_vocabulary_and_dspark_experts_are_checked():
    with pytest.raises(ValueError, match="does not divide the vocabulary of 129281 tokens"):
        ParallelConfig(tensor_parallel_size=2).validate_for(preset("tiny").replace(vocab_size=129281))
    ep8 = ParallelConfig(tensor_parallel_size=8, expert_parallel=True)
    ep8.validate_for(preset("v4.1-flash"), with_dspark=True)  # 384 and 128 experts over 8 ranks
    with pytest.raises(ValueError, match="do not divide the 12 DSpark routed experts"):
        ep8.validate_for(preset("v4.1-flash").replace(dspark_n_routed_experts=12), with_dspark=True)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="--tensor-parallel-size 0"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="--data-parallel-size 2 needs --enable-expert-parallel"):
        ParallelConfig(data_parallel_size=2)
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        ParallelConfig(expert_parallel="yes")
    c = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, expert_parallel=True)
    assert (c.world_size, c.expert_parallel_size) == (8, 8)
    assert ParallelConfig(tensor_parallel_size=4).expert_parallel_size == 1


def test_even_shard_is_contiguous_and_ragged():
    assert [even_shard(5, 2, i) for i in range(2)] == [Shard(0, 3), Shard(3, 2)]
    assert [even_shard(1, 2, i) for i in range(2)] == [Shard(0, 1), Shard(1, 0)]  # a decode row over TP 2
    assert [even_shard(7, 3, i).slice for i in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]
    with pytest.raises(ValueError, match="index 2"):
        even_shard(4, 2, 2)


def test_head_shard_is_whole_output_groups():
    assert HeadShard.of_rank(preset("v4.1-flash"), 3, 8) == HeadShard(24, 8, 3, 1)
    assert HeadShard.of_rank(preset("tiny"), 1, 2) == HeadShard(2, 2, 1, 1)


def test_shard_attention_refuses_a_shard_across_groups_and_a_second_shard():
    model = Transformer(preset("tiny"), dtype=torch.float64, with_dspark=False)
    attn, comm = model.layers[2].attn, GroupComm((0,), 0)
    with pytest.raises(ValueError, match="not a run of whole output groups"):
        shard_attention_(attn, comm, HeadShard(1, 2, 0, 1))
    shard_attention_(attn, comm, HeadShard(2, 2, 1, 1))
    assert attn.wq_b.weight.shape == (2 * 64, 32) and attn.wo_b.weight.shape == (64, 32)
    with pytest.raises(ValueError, match="already sharded"):
        shard_attention_(attn, comm, HeadShard(2, 2, 1, 1))
    groups = ParallelGroups(ParallelConfig(tensor_parallel_size=4), 0, comm, comm)
    with pytest.raises(ValueError, match="does not divide the 2 output groups"):
        shard_model_(model, groups)


class ThreadComm(GroupComm):
    """A group of threads standing in for ranks: only the amax exchange, through a shared box."""

    def __init__(self, index: int, box: list, barrier: threading.Barrier):
        self.ranks, self.rank, self.index, self.group = tuple(range(len(box))), index, index, None
        self.box, self.barrier = box, barrier

    def all_reduce_max(self, x):
        self.box[self.index] = x.clone()
        self.barrier.wait()
        out = torch.stack(self.box).amax(0)
        self.barrier.wait()
        return out


class NoExchange(ThreadComm):
    def all_reduce_max(self, x):
        return x


def _split_qdq(x: torch.Tensor, parts: int, comm_cls) -> torch.Tensor:
    box, barrier = [None] * parts, threading.Barrier(parts)
    width = x.shape[1]

    def rank(i):
        cols = even_shard(width, parts, i)
        return column_shard_qdq(x[:, cols.slice], cols, width, comm_cls(i, box, barrier))

    with ThreadPoolExecutor(parts) as pool:
        return torch.cat(list(pool.map(rank, range(parts))), dim=1)


@pytest.mark.parametrize(("width", "parts"), [(96, 2), (32, 4), (32, 2), (96, 3), (64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_column_slices_quantise_as_the_whole_row(width, parts, dtype):
    g = torch.Generator().manual_seed(width + parts)
    x = (torch.randn(7, width, generator=g) * torch.logspace(-3, 3, width)[torch.randperm(width, generator=g)])
    x = x.to(dtype)
    whole = fp8_qdq(x.float()).to(dtype)
    assert torch.equal(_split_qdq(x, parts, ThreadComm), whole)


def test_column_slices_without_the_amax_exchange_differ():
    """The exchange matters: a straddled block quantised with each rank's own amax is wrong.

    e4m3 keeps 3 mantissa bits at any scale, so a coarser scale only shows on values it pushes below the
    normal range (|x| / s < 2^-6): rank 0's half is made 2^20 times larger than rank 1's.
    """
    x = torch.randn(4, 32, dtype=torch.float64)
    x[:, :16] *= 2.0**20  # rank 0's half sets the block's scale
    whole = fp8_qdq(x.float()).double()
    assert torch.equal(_split_qdq(x, 2, ThreadComm), whole)
    assert not torch.equal(_split_qdq(x, 2, NoExchange), whole)


def test_column_slice_outside_the_row_is_refused():
    with pytest.raises(ValueError, match="must lie inside rows of width 32"):
        column_shard_qdq(torch.zeros(2, 16), Shard(24, 16), 32, GroupComm((0,), 0))


def test_real_geometry_shards_on_the_meta_device():
    """Rank 3 of TP 8 + EP 8 on flash-16e, planned without memory: the shapes a sharded loader fills, under
    the checkpoint's tensor names (no collective runs while sharding, so the group is a stand-in)."""
    with torch.device("meta"):
        model = Transformer(preset("flash-16e"), dtype=torch.bfloat16)
    comm = GroupComm(tuple(range(8)), 3, group=object())
    shard_model_(model, ParallelGroups(ParallelConfig(tensor_parallel_size=8, expert_parallel=True), 3, comm, comm))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["layers.5.attn.wq_b.weight"] == (8 * 512, 1280)  # 8 of 64 heads
    assert shapes["layers.5.attn.attn_sink"] == (8,)
    assert shapes["layers.5.attn.wo_a.weight"] == (1024, 8 * 512)  # output group 3 of 8
    assert shapes["layers.5.attn.wo_b.weight"] == (5120, 1024)
    assert shapes["layers.5.attn.wkv.weight"] == (512, 5120)  # the shared latent: replicated
    assert shapes["layers.2.attn.indexer.wq_b.weight"] == (32 * 128, 1280)  # replicated
    assert [k for k in shapes if k.startswith("layers.5.ffn.experts.") and k.endswith("w1.weight")] == [
        "layers.5.ffn.experts.6.w1.weight", "layers.5.ffn.experts.7.w1.weight"]  # experts 6, 7 of 16
    assert shapes["layers.5.ffn.shared_experts.w1.weight"] == (2304 // 8, 5120)
    assert shapes["layers.5.ffn.shared_experts.w2.weight"] == (5120, 2304 // 8)
    assert shapes["embed.weight"] == shapes["head.weight"] == (129280 // 8, 5120)
    assert shapes["mtp.0.ffn.experts.7.w2.weight"] == (5120, 2304)  # DSpark stages are split the same way
