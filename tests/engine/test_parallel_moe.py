"""Expert-parallel MoE across forked gloo ranks: data-parallel replicas with different row counts, one
of them idle (0 rows), as an executor's idle replica will call it. Each replica's output must equal the
single-process ``MoE`` on its rows to TOL relative (float64; measured 0.0: the routed experts are whole
on their owner and summed in the spec's order, the shared expert is whole at TP 1)."""

import math

import pytest
import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.moe import MoE
from flashtier.engine.parallel import ParallelConfig

from .conftest import rel_err
from .parallel_worker import Job, fork_ranks, free_port, moe_rank_main

TOL = 1e-12


def _moe(seed: int) -> MoE:
    cfg = preset("tiny")
    moe = MoE(cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, torch.float64).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            std = 1.0 / math.sqrt(p.shape[-1]) if p.dim() == 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
    return moe.eval()


@pytest.mark.parametrize("rows", [(9, 0), (5, 3), (0, 0)])
def test_expert_parallel_replicas_equal_the_moe(rows, tmp_path):
    moe = _moe(seed=3)
    d = moe.gate.weight.shape[1]
    xs = [torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + i))
          for i, n in enumerate(rows)]
    parallel = ParallelConfig(data_parallel_size=2, expert_parallel=True)
    outs = fork_ranks(moe_rank_main, (moe, xs), Job(parallel, free_port(), [], tmp_path))
    for x, y in zip(xs, outs):
        assert y.shape == x.shape and y.dtype == torch.float64
        if x.shape[0]:
            with torch.no_grad():
                want = moe(x)
            assert rel_err(y, want) <= TOL
            # a real check: another MoE's output is far away
            assert rel_err(_moe(seed=4)(x).detach(), want) > 1e-3
