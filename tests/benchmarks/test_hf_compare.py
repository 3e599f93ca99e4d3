"""The HF-comparison benchmark's config mapping (benchmarks/hf_compare_bench.py), checked without a GPU.

The mapping is pure Python: flashtier's ModelConfig -> DeepseekV4Config keyword arguments. The last test builds
HF's model on the meta device and runs only where transformers ships DeepSeek-V4.
"""

import pytest
import torch

from hf_compare_bench import SAME, hf_config_dict, hf_layer_types, prompts, stage
from flashtier.engine.model.config import preset

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

FLASH_16E = {  # the geometry the comparison must match (the brief's list, V4.1 values)
    "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 16,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2304, "n_shared_experts": 1, "vocab_size": 129280,
    "sliding_window": 128, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "rms_norm_eps": 1e-20,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
}


def test_flash_16e_geometry():
    kw = hf_config_dict(preset("flash-16e"))
    assert {k: kw[k] for k in FLASH_16E} == FLASH_16E
    assert kw["partial_rotary_factor"] * kw["head_dim"] == 64
    assert kw["rope_parameters"] == {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 65536}
    assert kw["mlp_layer_types"] == ["moe"] * 40  # V4.1 has no hash-routed layers


def test_ratio_matched_layers():
    """Layers 0-1 sliding, encoder 2-19 (ratio 2) CSA at rate 2, decoder 20-39 (ratio 1) HCA at rate 1."""
    kinds, rates = hf_layer_types(preset("flash-16e"), "ratio-matched")
    assert kinds == [SWA] * 2 + [CSA] * 18 + [HCA] * 20
    assert rates == {CSA: 2, HCA: 1}
    assert hf_layer_types(preset("tiny"), "ratio-matched") == (kinds, rates)  # tiny keeps the 40-layer layout


def test_v4_native_layers():
    kinds, rates = hf_layer_types(preset("flash-16e"), "v4-native")
    assert kinds == [SWA] * 2 + [CSA, HCA] * 19
    assert rates == {CSA: 4, HCA: 128}


@pytest.mark.parametrize("name", ["tiny", "flash-16e", "v4.1-flash"])
def test_shared_fields_follow_the_config(name):
    cfg = preset(name)
    kw = hf_config_dict(cfg)
    assert all(kw[k] == getattr(cfg, k) for k in SAME)
    assert kw["partial_rotary_factor"] * cfg.head_dim == cfg.qk_rope_head_dim
    assert len(kw["layer_types"]) == len(kw["mlp_layer_types"]) == cfg.num_hidden_layers


def test_a_changed_config_changes_exactly_its_fields():
    """The mapping reads the config (a hard-coded table would miss the change)."""
    cfg = preset("flash-16e")
    base = hf_config_dict(cfg)
    changed = hf_config_dict(cfg.replace(hidden_size=4096, n_routed_experts=256, num_experts_per_tok=8))
    assert {k for k in base if base[k] != changed[k]} == {"hidden_size", "n_routed_experts", "num_experts_per_tok"}
    assert changed["hidden_size"] == 4096 and changed["n_routed_experts"] == 256


def test_bad_layouts_raise():
    with pytest.raises(ValueError, match="layout"):
        hf_config_dict(preset("tiny"), "v4-pro")
    two_encoder_ratios = preset("tiny").replace(compress_ratios=(0, 0, 4) + (2,) * 17 + (1,) * 20 + (0, 0, 0))
    with pytest.raises(ValueError, match=r"encoder ratios \[2, 4\]"):
        hf_config_dict(two_encoder_ratios)


def test_prompts_are_seeded_by_batch():
    a, b = prompts(3, 17, 1000), prompts(3, 17, 1000)
    assert a.shape == (3, 17) and torch.equal(a, b)
    assert int(a.min()) >= 3 and int(a.max()) < 999


def test_stage_records_a_failure_and_goes_on():
    out = {"errors": []}
    assert stage(out, "ok", lambda x: x + 1, 1) == 2 and out["errors"] == []

    def boom():
        raise RuntimeError("out of memory")

    assert stage(out, "HF B=8", boom) is None
    assert [(e["stage"], e["error"]) for e in out["errors"]] == [("HF B=8", "RuntimeError: out of memory")]
    assert "boom" in out["errors"][0]["trace"]


def test_hf_builds_the_mapped_geometry_on_meta():
    pytest.importorskip("transformers.models.deepseek_v4")
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**hf_config_dict(preset("flash-16e")))
    assert config.qk_rope_head_dim == 64 and config.layer_types[2] == CSA and config.layer_types[20] == HCA
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM._from_config(config, dtype=torch.bfloat16)
    layers = model.model.layers
    assert len(layers) == 40
    assert tuple(layers[0].mlp.experts.gate_up_proj.shape) == (16, 2 * 2304, 5120)
    assert tuple(layers[0].self_attn.q_b_proj.weight.shape) == (64 * 512, 1280)
    assert layers[0].self_attn.compressor is None
    assert layers[2].self_attn.compressor.compress_rate == 2
    assert layers[2].self_attn.compressor.indexer.num_heads == 32
    assert layers[39].self_attn.compressor.compress_rate == 1
    n = sum(p.numel() for p in model.parameters())
    assert 30.0e9 < n < 32.0e9  # ~30.9 B parameters: ~62 GB in bf16, against ~20 GB for flashtier's formats
