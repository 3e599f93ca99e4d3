"""benchmarks/rank0_emulation.py, run on the CPU at a small geometry (its mechanics; timings mean nothing here).

Claims:
- rank 0's model is its share: 1/tp of the routed experts in MXFP4 (global ids 0..E/tp-1) and every MoE block
  swapped for the emulated one;
- each decode step records the collectives the real split would run, by kind: per layer one attention
  all-reduce and the MoE's one all-reduce of per-pair rows (a decode batch is under ``max_reduced_pairs``), plus
  the embedding's all-reduce and the logits' all-gather (and the shared-expert slice's block exchange where it
  straddles FP8 blocks, as at this width); with the all-reduce form off, the MoE's two all-to-alls (dispatch,
  combine) and its all-reduce instead; a miscount fails it;
- the MoE runs at least the most loaded rank's pair count (``--load max``), which is at least rank 0's own.
"""

from __future__ import annotations

import collections

import pytest
import torch

from flashtier.engine.model.config import preset
from flashtier.engine.parallel.expert_parallel_moe import RankExperts
from rank0_emulation import CallLog, EmulatedExpertParallelMoE, LinkModel, build_rank0, run_batch

TP = 4
CFG = {"n_routed_experts": 32, "o_groups": 4, "num_hidden_layers": 3, "compress_ratios": (2, 1, 1),
       "kv_source_layer_ids": (0, 1), "index_source_layer_ids": (0, 1, 2), "candidate_source_layer_id": 1,
       "engram_layer_ids": (1,), "dspark_target_layer_ids": (0, 1, 2)}


@pytest.mark.parametrize("reduced", [True, False])
def test_rank0_share_and_its_collectives_per_step(reduced):
    cfg = preset("tiny").replace(**CFG)
    log = CallLog()
    model = build_rank0(cfg, TP, torch.device("cpu"), torch.float32, log, seed=0)
    blocks = [b.ffn for b in model.layers]
    assert all(type(f) is EmulatedExpertParallelMoE and isinstance(f.experts, RankExperts) for f in blocks)
    assert blocks[0].experts.expert_ids.tolist() == list(range(32 // TP))
    if not reduced:
        for b in blocks:
            b.max_reduced_pairs = 0

    kinds: list[collections.Counter] = []  # per step: run_batch clears the log before each timed step

    class Recording(list):
        def clear(self):
            if self:
                kinds.append(collections.Counter(k for k, _ in self))
            super().clear()

    log.calls = Recording()
    row = run_batch(model, 2, 16, 2, torch.device("cpu"), "float32", log, LinkModel(1e-5, 3.5e11), TP)
    layers = cfg.num_hidden_layers
    want = {"all_reduce": 3 * layers + 1, "all_gather": 1}  # 3: attn, straddle, MoE
    if not reduced:
        want["all_to_all"] = 2 * layers
    assert kinds[-1] == collections.Counter(want), kinds[-1]
    assert row["collectives_per_step"] == sum(want.values())
    assert row["most_loaded_pairs_per_layer"] >= row["rank0_pairs_per_layer"] > 0
    assert row["collectives_ms_priced"] >= sum(want.values()) * 1e-2  # at least alpha (10 us) per call


def test_real_forward_rows_record_the_reduced_form_and_feed_the_graph_rows_pricing(monkeypatch):
    """--graphs runs the block's own forward (no padding, no host sync): the eager row records the same
    collectives per step as the emulated all-reduce form, and its call list is what a graph row prices."""
    cfg = preset("tiny").replace(**CFG)
    log = CallLog()
    model = build_rank0(cfg, TP, torch.device("cpu"), torch.float32, log, seed=0)
    monkeypatch.setattr(EmulatedExpertParallelMoE, "real_forward", True)
    row = run_batch(model, 2, 16, 2, torch.device("cpu"), "float32", log, LinkModel(1e-5, 3.5e11), TP)
    layers = cfg.num_hidden_layers
    kinds = collections.Counter(k for k, _ in row["step_calls"])
    assert kinds == collections.Counter({"all_reduce": 3 * layers + 1, "all_gather": 1}), kinds
    assert row["rank0_pairs_per_layer"] is None and row["cuda_graphs"] is False
    priced = CallLog(list(row["step_calls"])).priced_s(LinkModel(1e-5, 3.5e11), TP) * 1e3
    assert abs(priced - row["collectives_ms_priced"]) <= 5e-4  # the row rounds to 1 us
