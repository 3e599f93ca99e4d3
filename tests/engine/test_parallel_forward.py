"""Tensor-, expert- and data-parallel forward (engine/parallel/) against the single-process model, on gloo.

Each case forks one process per rank (tests/engine/parallel_worker.py); every rank shards the same
float64 ``tiny`` model with ``shard_model_`` and runs prefill of a prompt of a few dozen tokens (past
the 16-token window: compressed entries, top-k, the candidate pool and the decoder replay all bite)
plus DECODE_STEPS decode steps with the single-process incremental code. Every rank's logits must
equal the unsharded model's logits on the same tokens (``IncrementalModel``, the path test_oracle.py
holds to the plain-torch oracle) to TOL = 1e-12 relative (max |a - b| / max |b|), with the same greedy
tokens. Data-parallel replicas run different prompts (ragged lengths: uneven all-to-alls).

Measured: 0.0 on every rank of every case, i.e. bit-identical logits. Float64 adds the products of a
split dot product exactly here (every split GEMM's input is FP8-quantised and its weight is on the
FP8 / FP4 grid, so each product has at most 8 significant bits), so the summation order the split
changes cannot show; TOL stays at what float64 with another order would give.

Geometry: tiny has 4 heads in 2 output groups, so its attention splits over at most 2 ranks (wo_a is
split on group boundaries); its 8 experts split over 2 or 4 ranks; its 32-wide experts split over 2 or
4 ranks straddle FP8 activation blocks (column_quant.py). World size 4 therefore runs TP 2 x DP 2
with EP 4 on tiny, and TP 4 on tiny with 4 output groups of one head each (``TINY_G4``).

The detection tests inject a fault on one rank (a skipped attention all-reduce, a query shard one head
off) and require ``check_ranks`` to catch it.
"""

import pytest
import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.incremental import IncrementalModel, greedy_generate
from flashtier.engine.model.init import random_model
from flashtier.engine.parallel import ParallelConfig

from .conftest import random_prompt, rel_err
from .parallel_worker import Job, fork_ranks, free_port, rank_main

TOL = 1e-12
DECODE_STEPS = 4
PROMPT_LENGTHS = (40, 33)  # one prompt per data-parallel replica
TINY_G4 = {"o_groups": 4}


class Oracle:
    """The unsharded float64 model and its single-process runs, one per prompt (computed when first asked)."""

    def __init__(self, overrides: dict):
        self.model = random_model(preset("tiny").replace(**overrides), seed=7, dtype=torch.float64,
                                  with_dspark=False)
        self._runs: list[tuple[list[int], list[int], torch.Tensor]] = []

    def run(self, i: int) -> tuple[list[int], list[int], torch.Tensor]:
        """(prompt, tokens fed to the decode steps, logits [1 + DECODE_STEPS, V]) of prompt i."""
        while len(self._runs) <= i:
            prompt = random_prompt(PROMPT_LENGTHS[len(self._runs)], seed=40 + len(self._runs))
            tokens, logits = greedy_generate(IncrementalModel(self.model), prompt, 1 + DECODE_STEPS)
            self._runs.append((prompt, tokens[:-1], torch.stack(logits)))
        return self._runs[i]


@pytest.fixture(scope="module")
def oracles():
    made: dict[tuple, Oracle] = {}

    def get(overrides: dict) -> Oracle:
        key = tuple(sorted(overrides.items()))
        if key not in made:
            made[key] = Oracle(overrides)
        return made[key]

    return get


def run_ranks(oracle: Oracle, parallel: ParallelConfig, tmp, fault: str | None = None, fault_rank: int = 0):
    runs = [oracle.run(i)[:2] for i in range(parallel.data_parallel_size)]
    return fork_ranks(rank_main, (oracle.model,), Job(parallel, free_port(), runs, tmp, fault, fault_rank))


def check_ranks(oracle: Oracle, parallel: ParallelConfig, logits: list[torch.Tensor]) -> list[float]:
    """Assert every rank's logits equal its replica's single-process logits; returns the errors."""
    errs = []
    for rank, got in enumerate(logits):
        want = oracle.run(rank // parallel.tensor_parallel_size)[2]
        assert got.shape == want.shape and got.dtype == torch.float64
        errs.append(rel_err(got, want))
        assert torch.argmax(got, -1).tolist() == torch.argmax(want, -1).tolist(), f"rank {rank}: greedy tokens differ"
    assert max(errs) <= TOL, f"relative errors per rank {errs} exceed {TOL}"
    return errs


CASES = {
    # name: (model overrides, ParallelConfig fields)
    "tp2": ({}, {"tensor_parallel_size": 2}),
    "ep2_dp2": ({}, {"data_parallel_size": 2, "expert_parallel": True}),
    "tp2_ep2": ({}, {"tensor_parallel_size": 2, "expert_parallel": True}),
    "tp2_dp2_ep4": ({}, {"tensor_parallel_size": 2, "data_parallel_size": 2, "expert_parallel": True}),
    "tp4_g4": (TINY_G4, {"tensor_parallel_size": 4}),
    "tp4_ep4_g4": (TINY_G4, {"tensor_parallel_size": 4, "expert_parallel": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_logits_equal_single_process(case, oracles, tmp_path):
    overrides, fields = CASES[case]
    oracle, parallel = oracles(overrides), ParallelConfig(**fields)
    errs = check_ranks(oracle, parallel, run_ranks(oracle, parallel, tmp_path))
    print(f"{case}: relative error per rank {errs}")


# A rank that keeps its own partial sum diverges from its TP peers. With TP experts the peers then route
# differently and gloo stops the run on the mismatched collective sizes (a crash, not wrong logits); with
# EP each TP rank routes its own rows, so the run completes and the comparison has to catch it.
FAULTS = {
    "skip_allreduce": ({"tensor_parallel_size": 2, "expert_parallel": True}, 1),
    "head_off_by_one": ({"tensor_parallel_size": 2}, 0),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_rank_is_caught(fault, oracles, tmp_path):
    oracle = oracles({})
    fields, fault_rank = FAULTS[fault]
    parallel = ParallelConfig(**fields)
    logits = run_ranks(oracle, parallel, tmp_path, fault=fault, fault_rank=fault_rank)
    with pytest.raises(AssertionError):
        check_ranks(oracle, parallel, logits)
    errs = [rel_err(got, oracle.run(0)[2]) for got in logits]
    print(f"{fault}: relative error per rank {errs}")
    assert max(errs) > 1e-6
