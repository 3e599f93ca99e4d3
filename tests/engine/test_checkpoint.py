"""Checkpoint write -> raw headers -> load round trip, sharding, and the reader's error messages."""

import json
import logging
import os
import struct

import pytest
import torch

from flashtier.engine.model import checkpoint_reader
from flashtier.engine.model.checkpoint import (
    CheckpointError,
    CheckpointReader,
    quantize_roundtrip,
    read_config,
    write_checkpoint,
)

WQ_A = "layers.3.attn.wq_a.weight"
ENGRAM = "engram.embed.weight"
EXPERT = "layers.3.ffn.experts.7.w1.weight"
GATE = "layers.3.ffn.gate.weight"
SINK = "layers.3.attn.attn_sink"
NORM = "norm.weight"

FORMATS = {WQ_A: "fp8", ENGRAM: "fp8_rows", EXPERT: "mxfp4", GATE: "bf16", SINK: "fp32", NORM: "bf16"}
CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "hidden_size": 64,
    "quantization_config": {"weight_block_size": [32, 32], "scale_fmt": "ue8m0"},
}


def make_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {WQ_A: (70, 45), ENGRAM: (64, 256), EXPERT: (48, 64), GATE: (12, 64), SINK: (4,), NORM: (64,)}
    # Spread magnitudes over several binades so the per-block scales differ.
    return {n: torch.randn(s, generator=g) * torch.rand(s, generator=g).mul(8).exp2() for n, s in shapes.items()}


def shapes_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in tensors.items()}


def raw_header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {name: (e["dtype"], e["shape"]) for name, e in header.items()}


def load_all(directory, expected, **kwargs) -> dict[str, torch.Tensor]:
    return dict(CheckpointReader(directory).load(expected, progress=False, **kwargs))


@pytest.fixture
def tensors():
    return make_tensors()


@pytest.fixture
def ckpt(tmp_path, tensors):
    write_checkpoint(tmp_path, tensors, FORMATS, CONFIG)
    return tmp_path


def test_stored_layout_matches_official_names_and_dtypes(ckpt):
    (shard,) = set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert shard == "model-00001-of-00001.safetensors"
    assert raw_header(ckpt / shard) == {
        WQ_A: ("F8_E4M3", [70, 45]),
        "layers.3.attn.wq_a.scale": ("F8_E8M0", [3, 2]),  # ceil(70/32) x ceil(45/32)
        ENGRAM: ("F8_E4M3", [64, 256]),
        "engram.embed.scale": ("F8_E8M0", [64, 8]),  # one per 1x32 row block
        EXPERT: ("I8", [48, 32]),  # two e2m1 codes per byte
        "layers.3.ffn.experts.7.w1.scale": ("F8_E8M0", [48, 2]),
        GATE: ("BF16", [12, 64]),
        SINK: ("F32", [4]),
        NORM: ("BF16", [64]),
    }
    assert read_config(ckpt) == CONFIG
    assert json.loads((ckpt / "config.json").read_text()) == CONFIG
    assert not [p for p in os.listdir(ckpt) if p.startswith(".tmp")]


def test_mxfp4_packs_even_index_in_low_nibble(tmp_path):
    # Codes: 1.0 -> 0b0010, 6.0 -> 0b0111; one 32-group with amax 6 has scale 2^0 (e8m0 byte 127).
    w = torch.tensor([[1.0, 6.0] * 16])
    write_checkpoint(tmp_path, {"e.weight": w}, {"e.weight": "mxfp4"}, {})
    from safetensors import safe_open

    with safe_open(tmp_path / "model-00001-of-00001.safetensors", framework="pt") as f:
        codes, scale = f.get_tensor("e.weight"), f.get_tensor("e.scale")
    assert codes.dtype == torch.int8 and scale.dtype == torch.float8_e8m0fnu
    assert codes.view(torch.uint8).unique().tolist() == [0x72]
    assert scale.view(torch.uint8).tolist() == [[127]]
    assert torch.equal(load_all(tmp_path, {"e.weight": (1, 32)})["e.weight"], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_load_equals_quantize_roundtrip_exactly(ckpt, tensors, dtype):
    want = quantize_roundtrip(tensors, FORMATS, dtype=dtype)
    got = load_all(ckpt, shapes_of(tensors), dtype=dtype)
    assert got.keys() == tensors.keys()
    for name in tensors:
        assert got[name].dtype == dtype and got[name].shape == tensors[name].shape, name
        assert torch.equal(got[name], want[name]), name


def test_roundtrip_is_close_to_original(tensors):
    snapped = quantize_roundtrip(tensors, FORMATS)
    assert torch.equal(snapped[SINK], tensors[SINK])
    # Worst-case error of one element: bf16 2^-9, e4m3 2^-4 (relative); e2m1 amax/4 (the 4..6 gap with
    # amax/scale in (4, 6] after rounding the scale up to a power of two).
    for name, tol in [(GATE, 2**-8), (WQ_A, 2**-3), (ENGRAM, 2**-3)]:
        err = (snapped[name] - tensors[name]).abs() / tensors[name].abs().clamp_min(1e-3)
        assert err[tensors[name].abs() > 1].max() < tol, name
    blocks = tensors[EXPERT].view(48, 2, 32)
    err = (snapped[EXPERT].view(48, 2, 32) - blocks).abs() / blocks.abs().amax(-1, keepdim=True)
    assert err.max() <= 1 / 4


def test_sharding_splits_with_consistent_index(tmp_path, tensors):
    shards = write_checkpoint(tmp_path, tensors, FORMATS, CONFIG, max_shard_bytes=4096)
    n = len(shards)
    assert n >= 3
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors")) == shards
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    headers = {s: raw_header(tmp_path / s) for s in shards}
    stored = {name: shard for shard, h in headers.items() for name in h}
    assert index["weight_map"] == stored  # every stored tensor indexed exactly where it lives
    assert index["weight_map"][WQ_A] == index["weight_map"]["layers.3.attn.wq_a.scale"]
    sizes = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}
    total = sum(sizes[dt] * torch.Size(shape).numel() for h in headers.values() for dt, shape in h.values())
    assert index["metadata"]["total_size"] == total
    got = load_all(tmp_path, shapes_of(tensors))
    want = quantize_roundtrip(tensors, FORMATS)
    assert all(torch.equal(got[n], want[n]) for n in tensors)

    # Rewriting with fewer shards removes the stale ones.
    assert write_checkpoint(tmp_path, tensors, FORMATS, CONFIG) == ["model-00001-of-00001.safetensors"]
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors")) == ["model-00001-of-00001.safetensors"]


def test_reader_knows_headers_without_opening_shards(ckpt, tensors, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("shard opened before load() was iterated")

    monkeypatch.setattr(checkpoint_reader, "safe_open", refuse)
    reader = CheckpointReader(ckpt)
    assert reader.tensors[EXPERT].dtype == "I8" and reader.tensors[EXPERT].shape == (48, 32)
    assert {n: (reader.plan(n).fmt and reader.plan(n).fmt.value) for n in tensors} == FORMATS
    assert reader.plan(EXPERT).shape == (48, 64)
    stream = reader.load(shapes_of(tensors), progress=False)  # validation happens here, reading does not
    with pytest.raises(AssertionError, match="shard opened"):
        next(stream)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path, tensors):
    tensors[WQ_A] = tensors[WQ_A][:, :44]
    write_checkpoint(tmp_path, tensors, FORMATS, CONFIG)
    expected = shapes_of(make_tensors())
    expected[EXPERT] = (48, 128)
    with pytest.raises(CheckpointError) as exc:
        CheckpointReader(tmp_path).load(expected, progress=False)
    msg = str(exc.value)
    assert f"{WQ_A}: expected shape [70, 45], checkpoint stores F8_E4M3 [70, 44]" in msg
    assert f"{EXPERT}: expected shape [48, 128], checkpoint stores I8 [48, 32] (mxfp4, logical shape [48, 64])" in msg


def test_missing_tensor_names_tensor_and_directory(ckpt, tensors):
    expected = shapes_of(tensors) | {"layers.4.attn.wkv.weight": (512, 64)}
    with pytest.raises(CheckpointError, match="missing") as exc:
        CheckpointReader(ckpt).load(expected, progress=False)
    assert "layers.4.attn.wkv.weight" in str(exc.value) and str(ckpt) in str(exc.value)


def test_extra_tensor_is_an_error_unless_not_strict(ckpt, tensors):
    expected = shapes_of(tensors)
    del expected[NORM]
    with pytest.raises(CheckpointError, match=rf"unexpected .*{NORM}.*strict=False"):
        CheckpointReader(ckpt).load(expected, progress=False)
    assert load_all(ckpt, expected, strict=False).keys() == expected.keys()


def test_vision_tensors_skipped_with_one_log_line(tmp_path, tensors, caplog):
    qkv = "vision.blocks.0.attn.qkv.weight"
    vision = {qkv: torch.randn(96, 32), "vision.patch_embed.weight": torch.randn(32, 32),
              "aligner.fc1.weight": torch.randn(64, 32),
              "image_newline": torch.randn(64), "image_start": torch.randn(64)}
    vision_formats = {n: "fp8" if n == qkv else "bf16" for n in vision}
    write_checkpoint(tmp_path, tensors | vision, FORMATS | vision_formats, CONFIG)
    caplog.set_level(logging.DEBUG, logger="flashtier.engine.checkpoint")
    got = load_all(tmp_path, shapes_of(tensors))
    assert got.keys() == tensors.keys()
    records = [r for r in caplog.records if r.name == "flashtier.engine.checkpoint"]
    # Six stored tensors: the fp8 qkv weight brings its .scale.
    assert len(records) == 1
    assert "skipping 6 vision tensors" in records[0].getMessage()
    assert "not supported" in records[0].getMessage()


def test_single_file_checkpoint(ckpt, tensors):
    os.replace(ckpt / "model-00001-of-00001.safetensors", ckpt / "model.safetensors")
    os.remove(ckpt / "model.safetensors.index.json")
    got = load_all(ckpt, shapes_of(tensors))
    want = quantize_roundtrip(tensors, FORMATS)
    assert all(torch.equal(got[n], want[n]) for n in tensors)


def test_directory_without_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        read_config(tmp_path)


def test_fp8_weight_without_scale_is_reported(ckpt, tensors):
    from safetensors.torch import load_file, save_file

    shard = ckpt / "model-00001-of-00001.safetensors"
    stored = load_file(shard)
    del stored["layers.3.attn.wq_a.scale"]
    save_file(stored, shard)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.3.attn.wq_a.scale"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"wq_a.weight: stored as F8_E4M3 \[70, 45\] .*wq_a.scale"):
        CheckpointReader(ckpt).load(shapes_of(tensors), progress=False)


def test_writer_rejects_bad_formats(tmp_path, tensors):
    with pytest.raises(CheckpointError, match=f"{SINK}: no storage format"):
        write_checkpoint(tmp_path, tensors, {n: f for n, f in FORMATS.items() if n != SINK}, CONFIG)
    with pytest.raises(CheckpointError, match="unknown storage format 'fp16'"):
        write_checkpoint(tmp_path, tensors, FORMATS | {NORM: "fp16"}, CONFIG)
    with pytest.raises(CheckpointError, match=r"\*\.weight"):
        quantize_roundtrip({SINK: tensors[SINK][None]}, {SINK: "fp8"})
    assert not os.listdir(tmp_path)
