"""A checkpoint loaded in its stored formats (FP8 linears, MXFP4 experts kept quantised) equals the float load.

On the CPU the quantised modules compute through their references, which dequantise exactly, so the two
models must give the same logits (tolerance 1e-6 relative: only the MoE's summation order differs). A model
whose w1 / w3 were swapped while loading is caught (O(1) differences).
"""

import pytest
import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.device_loader import load_model_in_formats, place_in_formats_
from flashtier.engine.model.expert_weights import ExpertWeights
from flashtier.engine.model.fp8_linear import Fp8Linear
from flashtier.engine.model.incremental import IncrementalModel
from flashtier.engine.model.init import random_model
from flashtier.engine.model.loader import load_model, save_model
from flashtier.engine.model.moe import MoE

from .conftest import random_prompt

TOL = 1e-6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_model(random_model(preset("tiny"), seed=3, with_dspark=False), tmp_path_factory.mktemp("ckpt"))


def _logits(model, prompt):
    return IncrementalModel(model).prefill(IncrementalModel(model).new_state(), prompt)


def _rel(a, b):
    return float((a - b).abs().max() / a.abs().max())


def test_stored_formats_load_equals_float_load(ckpt):
    ref = load_model(ckpt, with_dspark=False, progress=False)
    q = load_model_in_formats(ckpt, "cpu", dtype=torch.float32, progress=False)
    assert sum(isinstance(m, Fp8Linear) for m in q.modules()) == 40 * 5 + sum(
        1 for b in q.layers if b.attn.indexer is not None) + sum(1 for b in q.layers if b.engram is not None)
    moes = [m for m in q.modules() if isinstance(m, MoE)]
    assert moes and all(isinstance(m.experts, ExpertWeights) and m.shared_experts is None for m in moes)
    prompt = random_prompt(20, seed=1)
    assert _rel(_logits(ref, prompt), _logits(q, prompt)) < TOL


def test_place_in_formats_equals_float(ckpt):
    ref = load_model(ckpt, with_dspark=False, progress=False)
    q = place_in_formats_(load_model(ckpt, with_dspark=False, progress=False), "cpu")
    prompt = random_prompt(12, seed=2)
    assert _rel(_logits(ref, prompt), _logits(q, prompt)) < TOL


def test_a_swapped_projection_is_caught(ckpt, monkeypatch):
    import flashtier.engine.model.device_loader as dl

    real = dl._experts
    monkeypatch.setattr(dl, "_experts", lambda moe, parts, device: real(
        moe, {**parts, ("w1", 0): parts[("w3", 0)], ("w3", 0): parts[("w1", 0)]}, device))
    ref = load_model(ckpt, with_dspark=False, progress=False)
    q = load_model_in_formats(ckpt, "cpu", dtype=torch.float32, progress=False)
    prompt = random_prompt(20, seed=1)
    assert _rel(_logits(ref, prompt), _logits(q, prompt)) > 1e-3
