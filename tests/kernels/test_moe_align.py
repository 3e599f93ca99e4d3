"""moe_align: the Triton kernel (interpreted on the CPU) against the plain-torch reference, exactly.

Grids: tokens N in {1, 3, 17, 64, 300} x (experts, top-k) in {(16, 6), (8, 2)} x block_m in {16, 64},
routings drawn at random, all tokens on the same k experts (one expert holds N pairs, the rest none),
and a block_m of 1. Beyond equality with the reference, the layout itself is checked: every pair appears
once, in its expert's run, runs ascending by expert and by flat id, and unused entries are sentinels.
"""

import pytest
import torch

from flashtier.kernels.moe.align import max_blocks, moe_align

TOKENS = [1, 3, 17, 64, 300]
EXPERTS = [(16, 6), (8, 2)]


def routing(n, e, k, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "same":
        return torch.arange(k, dtype=torch.int32).expand(n, k).contiguous()
    return torch.rand(n, e, generator=g).argsort(dim=1)[:, :k].to(torch.int32)


def check_layout(al, idx, e):
    n_pairs = idx.numel()
    flat = idx.reshape(-1).long()
    ids, bex = al.sorted_ids.long(), al.block_expert.long()
    assert ids.numel() == max_blocks(n_pairs, e, al.block_m) * al.block_m
    real = ids < n_pairs
    assert torch.equal(ids[real].sort().values, torch.arange(n_pairs))  # every pair once
    expert_of_row = bex.repeat_interleave(al.block_m)
    assert torch.equal(flat[ids[real]], expert_of_row[real])  # each pair in its expert's blocks
    used = bex >= 0
    assert bool((used[:-1] >= used[1:]).all())  # used blocks first, ascending experts
    assert bool((bex[used][1:] >= bex[used][:-1]).all())
    runs = ids[real].view(-1)
    same = flat[runs][1:] == flat[runs][:-1]
    assert bool((runs[1:][same] > runs[:-1][same]).all())  # ascending flat id inside an expert
    assert bool((ids[~expert_of_row.ge(0)] == n_pairs).all())
    first = al.first_block.long()  # expert j's blocks are [first[j], first[j + 1]); first[e] = the used blocks
    assert first.numel() == e + 1 and int(first[0]) == 0 and int(first[-1]) == int(used.sum())
    assert torch.equal(bex[used], torch.arange(e).repeat_interleave(first[1:] - first[:-1]))


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("e,k", EXPERTS, ids=lambda v: str(v))
@pytest.mark.parametrize("n", TOKENS)
def test_triton_equals_reference(n, e, k, block_m):
    idx = routing(n, e, k, "random", seed=n)
    ref = moe_align(idx, e, block_m, impl="reference")
    out = moe_align(idx, e, block_m, impl="triton")
    assert torch.equal(ref.sorted_ids, out.sorted_ids) and torch.equal(ref.block_expert, out.block_expert)
    assert torch.equal(ref.first_block, out.first_block)
    check_layout(ref, idx, e)


@pytest.mark.parametrize("n,e,k,block_m", [(300, 16, 6, 16), (17, 8, 2, 1), (64, 16, 6, 64)])
def test_skewed_and_small_blocks(n, e, k, block_m):
    idx = routing(n, e, k, "same") if block_m != 1 else routing(n, e, k, "random")
    ref = moe_align(idx.long(), e, block_m, impl="reference")
    out = moe_align(idx.long(), e, block_m, impl="triton")
    assert torch.equal(ref.sorted_ids, out.sorted_ids) and torch.equal(ref.block_expert, out.block_expert)
    assert torch.equal(ref.first_block, out.first_block)
    check_layout(ref, idx, e)


def test_example_from_the_docstring():
    al = moe_align(torch.tensor([[2, 0], [2, 3]]), n_experts=4, block_m=4, impl="triton")
    assert al.sorted_ids[:16].tolist() == [1, 4, 4, 4, 0, 2, 4, 4, 3, 4, 4, 4, 4, 4, 4, 4]
    assert al.block_expert.tolist() == [0, 2, 3, -1, -1]
    assert al.first_block.tolist() == [0, 1, 1, 2, 3]


def test_a_wrong_expert_id_is_detected():
    idx = routing(17, 8, 2, "random")
    out = moe_align(idx, 8, 16, impl="triton")
    idx[3, 1] = (idx[3, 1] + 1) % 8
    ref = moe_align(idx, 8, 16, impl="reference")
    assert not torch.equal(ref.sorted_ids, out.sorted_ids)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="idx must be a 2-D int32/int64"):
        moe_align(torch.zeros(3, 2), 8, 16)
    with pytest.raises(ValueError, match="block_m must be a positive power of two"):
        moe_align(torch.zeros(3, 2, dtype=torch.int32), 8, 24)
    with pytest.raises(ValueError, match="n_experts must be an int"):
        moe_align(torch.zeros(3, 2, dtype=torch.int32), 0, 16)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"):
        moe_align(torch.full((3, 2), 8, dtype=torch.int32), 8, 16, impl="reference")
