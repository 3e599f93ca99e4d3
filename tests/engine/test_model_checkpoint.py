"""A model written in the official layout loads back with identical logits; bad tensors are named."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashtier.engine.model.checkpoint import CheckpointError
from flashtier.engine.model.dspark import dspark_propose, new_rings, seed_rings
from flashtier.engine.model.loader import load_model, save_model
from flashtier.engine.model.reference import Plan, reference_forward

from .conftest import random_prompt


@pytest.fixture(scope="module")
def written(tiny32, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_model(tiny32, path, max_shard_bytes=20 << 20)
    return path


def test_round_trip_gives_identical_logits(tiny32, written):
    index = json.loads((written / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    names = set(index["weight_map"])
    assert "layers.3.attn.wq_a.scale" in names and "layers.0.ffn.experts.0.w1.scale" in names
    assert "layers.1.engram.embed.scale" in names and "mtp.0.main_proj.weight" in names
    assert not any(n.startswith("model.") for n in names)
    loaded = load_model(written, progress=False)
    seq = torch.tensor(random_prompt(40, seed=21))
    a = reference_forward(tiny32, seq, Plan.full(40, logits_from=30)).logits
    b = reference_forward(loaded, seq, Plan.full(40, logits_from=30)).logits
    assert torch.equal(a, b)
    for (na, pa), (nb, pb) in zip(tiny32.named_parameters(), loaded.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na


def test_wrong_shape_names_the_tensor_and_both_shapes(written, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(written, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "layers.5.attn.kv_norm.weight"
    shard = bad / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = torch.ones(63)
    save_file(tensors, shard)
    with pytest.raises(CheckpointError) as err:
        load_model(bad, progress=False)
    msg = str(err.value)
    assert name in msg and "64" in msg and "63" in msg


def test_dspark_drafter_forward(tiny32):
    cfg = tiny32.cfg
    rings = new_rings(cfg, len(tiny32.mtp))
    hidden = torch.randn(6, len(cfg.dspark_target_layer_ids), cfg.hidden_size)
    seed_rings(tiny32, rings, hidden, torch.arange(6))
    out = dspark_propose(tiny32, rings, last_token=42, pos=6)
    again = dspark_propose(tiny32, rings, last_token=42, pos=6)
    assert out.tokens.shape == (cfg.dspark_block_size,) and out.logits.shape == (5, cfg.vocab_size)
    assert torch.equal(out.tokens, again.tokens) and torch.isfinite(out.confidence).all()
    assert out.tokens.tolist() == torch.argmax(out.logits, -1).tolist()
    other = dspark_propose(tiny32, rings, last_token=43, pos=6)
    assert not torch.equal(other.logits, out.logits)


def test_without_the_drafter_its_tensors_are_left_unread_without_a_word(written, tmp_path, caplog):
    """The written checkpoint keeps the official layout (mtp.*); loading without speculation skips those by
    name, silently, while any other stored tensor the model does not use is still reported."""
    import shutil

    caplog.set_level("DEBUG", logger="flashtier")
    loaded = load_model(written, progress=False, with_dspark=False)
    assert len(loaded.mtp) == 0
    assert [r.getMessage() for r in caplog.records if "unexpected" in r.getMessage()] == []

    extra = tmp_path / "extra"
    shutil.copytree(written, extra)
    index = json.loads((extra / "model.safetensors.index.json").read_text())
    shard = extra / index["weight_map"]["layers.5.attn.kv_norm.weight"]
    tensors = load_file(shard)
    tensors["layers.5.attn.unused_probe"] = torch.ones(3)
    save_file(tensors, shard)
    index["weight_map"]["layers.5.attn.unused_probe"] = shard.name
    (extra / "model.safetensors.index.json").write_text(json.dumps(index))
    caplog.clear()
    load_model(extra, progress=False, with_dspark=False)
    lines = [r.getMessage() for r in caplog.records if "unexpected" in r.getMessage()]
    assert len(lines) == 1 and "1 unexpected" in lines[0] and "unused_probe" in lines[0] and "mtp." not in lines[0]
