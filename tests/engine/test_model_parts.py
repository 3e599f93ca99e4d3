"""Unit checks of the model's pieces against hand-derived expectations."""

import math

import pytest
import torch

from flashtier.engine.model.compressor import Compressor
from flashtier.engine.model.config import from_hf_dict, preset
from flashtier.engine.model.engram import engram_multipliers, engram_primes, ngram_ids
from flashtier.engine.model.indexer import candidate_pool, select_topk
from flashtier.engine.model.mhc import hc_mixes
from flashtier.engine.model.rope import make_rope, rope_frequencies


def test_layer_roles_of_the_real_config():
    roles = preset("v4.1-flash").layer_roles()
    assert [r.role for r in roles[:2]] == ["swa", "swa"]
    assert {r.index for r in roles if r.role == "full"} == {2, 8, 14, 20}
    assert {r.index for r in roles if r.role == "reindex"} == {24, 28, 32, 36}
    assert all(r.ratio == 2 and r.part == "encoder" for r in roles[2:20])
    assert all(r.ratio == 1 and r.part == "decoder" for r in roles[20:])
    assert roles[7].kv_source == 2 and roles[13].kv_source == 8 and roles[27].kv_source == 20
    assert roles[27].index_source == 24 and roles[23].index_source == 20
    tiny = preset("tiny").layer_roles()
    assert [(r.part, r.role, r.ratio) for r in tiny] == [(r.part, r.role, r.ratio) for r in roles]


def test_hf_config_with_text_config_and_yarn():
    raw = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "bos_token_id": 0,
        "text_config": {
            "hidden_size": 5120, "num_hidden_layers": 40, "rms_norm_eps": 1e-20,
            "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
            "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                             "original_max_position_embeddings": 65536},
            "some_future_key": 3,
        },
    }
    cfg = from_hf_dict(raw)
    assert cfg.rope_factor == 16 and cfg.original_seq_len == 65536 and cfg.compress_ratios[20] == 1
    assert ("some_future_key", "3") in cfg.extra
    with pytest.raises(ValueError, match="compress_ratios"):
        from_hf_dict({"num_hidden_layers": 50})


def test_sinkhorn_mixing_is_doubly_stochastic():
    cfg = preset("tiny")
    hc, d = cfg.hc_mult, cfg.hidden_size
    x = torch.randn(5, hc, d)
    mix = hc_mixes(x, torch.randn(24, hc * d) * 0.1, torch.randn(24), torch.ones(3),
                   norm_eps=1e-20, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
    # 20 iterations end on a column normalisation: columns exact, rows converged to ~1e-2
    assert torch.allclose(mix.comb.sum(-1), torch.ones(5, hc), atol=1e-2)
    assert torch.allclose(mix.comb.sum(-2), torch.ones(5, hc), atol=1e-5)
    assert bool((mix.post > 0).all() and (mix.post < 2).all() and (mix.pre > 0).all())


def test_rope_inverse_and_yarn():
    cfg = preset("v4.1-flash")
    plain, yarn = rope_frequencies(cfg, False), rope_frequencies(cfg, True)
    assert torch.allclose(plain[0], yarn[0])  # highest frequency untouched
    assert torch.allclose(yarn[-1], rope_frequencies(cfg.replace(compress_rope_theta=10000.0), False)[-1] * 0 + (
        1.0 / (160000.0 ** ((cfg.qk_rope_head_dim - 2) / cfg.qk_rope_head_dim)) / 16), rtol=1e-6)
    rope = make_rope(cfg, yarn=True)
    x = torch.randn(3, 2, cfg.head_dim)
    pos = torch.tensor([0, 5, 1000])
    y = rope.apply(x, pos)
    assert torch.equal(y[..., : -cfg.qk_rope_head_dim], x[..., : -cfg.qk_rope_head_dim])
    assert torch.allclose(y[0], x[0])  # position 0 is the identity
    assert torch.allclose(rope.apply(y, pos, inverse=True), x, atol=1e-5)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4)


def test_ratio2_compressor_is_chunk_invariant_and_softmax_pooled():
    cfg = preset("tiny")
    comp = Compressor(cfg, 2, torch.float64).double()
    torch.nn.init.normal_(comp.wkv.weight)
    torch.nn.init.normal_(comp.wgate.weight)
    h = torch.randn(9, cfg.hidden_size, dtype=torch.float64)
    whole, ids, part = comp.latents(h, torch.arange(9), None)
    assert ids.tolist() == [0, 1, 2, 3] and part is not None and part.position == 8
    a, ia, pa = comp.latents(h[:3], torch.arange(3), None)
    b, ib, pb = comp.latents(h[3:], torch.arange(3, 9), pa)
    assert torch.allclose(torch.cat((a, b)), whole) and torch.cat((ia, ib)).tolist() == ids.tolist()
    kv, z = h[:2] @ comp.wkv.weight.t(), h[:2] @ comp.wgate.weight.t()
    w = torch.softmax(z, dim=0)  # per channel over the two tokens
    assert torch.allclose(comp.norm((w * kv).sum(0)), whole[0])


def test_select_topk_ties_visibility_and_padding():
    scores = torch.tensor([[0.0, 0.0, 0.0, 5.0, 1.0, 9.0]])
    idx = select_topk(scores, torch.tensor([5]), 3)
    assert idx.tolist() == [[0, 3, 4]]  # entry 5 invisible; ties at 0 go to the lower index
    idx = select_topk(scores, torch.tensor([2]), 3)
    assert idx.tolist() == [[0, 1, -1]]
    allowed = torch.tensor([[False, True, True, True, False, True]])
    assert select_topk(scores, torch.tensor([6]), 3, allowed).tolist() == [[1, 3, 5]]


def test_candidate_pool_pins_the_newest_block():
    scores = torch.zeros(1, 40)
    scores[0, :8] = 10.0  # block 0 is best
    scores[0, 16:24] = 5.0  # block 2 second
    pool = candidate_pool(scores, torch.tensor([33]), block=8, n_blocks=2)
    kept = sorted({int(j) // 8 for j in torch.nonzero(pool[0]).flatten()})
    assert kept == [0, 4]  # newest block (entry 32) pinned + best block
    assert not bool(pool[0, 33:].any())


def test_engram_hashing_constants():
    cfg = preset("v4.1-flash")
    primes = engram_primes(cfg)
    flat = [p for layer in primes.values() for heads in layer for p in heads]
    assert len(flat) == 48 and len(set(flat)) == 48 and min(flat) >= cfg.engram_vocab_size
    assert all(all(p % f for f in range(2, int(math.isqrt(p)) + 1)) for p in flat[:3])
    rows = [sum(sum(h) for h in layer) for layer in primes.values()]
    assert abs(rows[0] - 384006168) / 384006168 < 1e-3 and abs(rows[1] - 384016682) / 384016682 < 1e-3
    m = engram_multipliers(cfg, 1)
    assert len(m) == 4 and all(v % 2 == 1 for v in m)
    assert max(m) * cfg.engram_compressed_vocab < 2**63
    ids = ngram_ids(torch.arange(10), torch.tensor([4, 5, 6]), 4, pad_class=2)
    assert ids.tolist() == [[4, 2, 2, 2], [5, 4, 2, 2], [6, 5, 4, 2]]
