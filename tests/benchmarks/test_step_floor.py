"""The KV term of the decode-step floor (benchmarks/_step_floor.py) against hand arithmetic for V4.1-Flash.

Per row and step (real geometry, layers 0-1 SWA only, 2-19 ratio 2, 20-39 ratio 1):
window 40 x 128 x 528 B; selected entries 38 x min(entries, 512) x 288 B; index keys 68 B each: every visible
entry at the Full layers (20: N, 2 / 8 / 14: N / 2 each), only the 2048 x 8 candidate pool at the 4 Reindex layers.
"""

import pytest

from _step_floor import kv_bytes
from flashtier.engine.model.config import preset

CASES = [  # context -> bytes per row
    pytest.param(4096, 40 * 128 * 528 + 38 * 512 * 288 + (4096 + 3 * 2048) * 68 + 4 * 4096 * 68, id="4K"),
    pytest.param(131072, 40 * 128 * 528 + 38 * 512 * 288 + (131072 + 3 * 65536) * 68 + 4 * 16384 * 68, id="128K"),
    pytest.param(1 << 20, 40 * 128 * 528 + 38 * 512 * 288 + (1 << 20) * 68 * 5 // 2 + 4 * 16384 * 68, id="1M"),
    pytest.param(101, 40 * 101 * 528 + 18 * 50 * 288 + 20 * 101 * 288 + (101 + 3 * 50) * 68 + 4 * 101 * 68,
                 id="101-short"),
]


@pytest.mark.parametrize("context,per_row", CASES)
def test_kv_bytes_per_row(context, per_row):
    cfg = preset("v4.1-flash")
    assert kv_bytes(cfg, 1, context) == per_row
    assert kv_bytes(cfg, 64, context) == 64 * per_row


def test_kv_bytes_grow_with_the_full_sweeps_only():
    """From 4K to 1M only the Full layers' key sweeps grow: 2.5 keys of 68 B per token of context."""
    cfg = preset("v4.1-flash")
    assert kv_bytes(cfg, 1, 1 << 20) - kv_bytes(cfg, 1, 1 << 19) == (1 << 19) * 68 * 5 // 2
    assert kv_bytes(cfg, 1, 1 << 20) == 191_021_056  # 191 MB per row at 1M: 2.7 + 5.6 + 178.3 + 4.5 MB


def test_profile_by_weight_labels_each_call_and_restores_the_model():
    """On the CPU (times are CPU times): every invariant linear and MoE layer of a tiny step gets its label, the
    head once per step, and the patched methods are the originals again afterwards."""
    import torch

    from _step_floor import profile_by_weight
    from flashtier.engine.config import EngineConfig
    from flashtier.engine.engine import Engine
    from flashtier.engine.model import fp8_linear, numerics
    from flashtier.engine.model.init import random_model
    from flashtier.engine.model.moe import MoE
    from flashtier.engine.model.placement import quantize_linears_
    from flashtier.engine.sample.params import SamplingParams
    from flashtier.kvstore.config import KVStoreConfig

    cfg = preset("tiny")
    model = random_model(cfg, seed=0, dtype=torch.float32)
    quantize_linears_(model, "cpu")
    engine = Engine(model, EngineConfig(max_num_seqs=2, forward="batched"), KVStoreConfig(block_size=16, num_blocks=64))
    for i in range(2):
        engine.add_request(f"r{i}", [5 + i, 9, 11, 13], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill
    saved = (fp8_linear.Fp8Linear.forward, MoE.forward, numerics.invariant_linear)
    rows = profile_by_weight(engine, torch.device("cpu"), rate=1e11)
    assert (fp8_linear.Fp8Linear.forward, MoE.forward, numerics.invariant_linear) == saved
    head = f"linear {cfg.vocab_size}x{cfg.hidden_size}"
    assert rows[head]["calls"] == 1 and rows[head]["weight_bytes"] == cfg.vocab_size * cfg.hidden_size * 4
    n_moe = sum(isinstance(b.ffn, MoE) for b in model.layers)
    assert rows["moe layer"]["calls"] == n_moe  # each layer once (encoder layers on the encoder rows, decoder ...)
    fp8 = [k for k in rows if k.startswith("fp8 ")]
    assert fp8 and all(rows[k]["calls"] > 0 and rows[k]["ratio"] > 0 for k in fp8)


def test_step_phases_split_a_padded_step_and_restore_the_graphs():
    """On the CPU the decode graphs run their padded program eagerly (``capture=False``): every timed step loads
    and runs it once, the phases lie inside the step, and the patched methods are the originals afterwards."""
    import torch

    from _step_floor import step_phases
    from flashtier.engine.config import EngineConfig
    from flashtier.engine.engine import Engine
    from flashtier.engine.model.init import random_model
    from flashtier.engine.runner.decode_graphs import DecodeGraphs
    from flashtier.engine.sample.params import SamplingParams
    from flashtier.kvstore.config import KVStoreConfig

    model = random_model(preset("tiny"), seed=0, dtype=torch.float32)
    engine = Engine(model, EngineConfig(max_num_seqs=2, forward="batched"), KVStoreConfig(block_size=16, num_blocks=64))
    assert step_phases(engine, torch.device("cpu"), 1) == {"skipped": "no decode graphs"}
    paged = engine.runner.paged
    paged.graphs = graphs = DecodeGraphs(model, paged.views, engine.kvm.arena.pad_slot, paged.sources, capture=False,
                                         max_rows=4)
    for i in range(2):
        engine.add_request(f"r{i}", [5 + i, 9, 11, 13], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill (eager: not decode-shaped)
    runs = graphs.runs
    out = step_phases(engine, torch.device("cpu"), 3)
    assert graphs.runs == runs + 3 and out["steps"] == 3
    assert "_load" not in vars(graphs) and "_program" not in vars(graphs)  # the instance patches are gone
    parts = ("before_load", "load", "launch", "after")
    assert all(out[k] >= 0 for k in parts)
    assert out["replay_device"] == out["launch"] > 0  # on the CPU the program runs inside the call
    # each part lies inside its step, so each part's median is at most the steps' median (medians of parts do
    # not add up to the whole's: their sum is not bounded by it)
    assert all(out[k] <= out["step"] for k in parts)
