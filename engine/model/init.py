"""Seeded random weights for a model (tests, benchmarks and the demo checkpoint).

Scales are chosen so activations stay O(1) through 40 layers of mHC; every mixing, gating and
routing path gets non-trivial values so tests exercise it. ``snap_to_formats`` then rounds each
tensor to exactly what its checkpoint format can hold, so a written-and-loaded model is bit-equal.
"""

from __future__ import annotations

import math

import torch

from flashtier.engine.model.transformer import Transformer, weight_formats


@torch.no_grad()
def init_random_(model: Transformer, seed: int = 0) -> Transformer:
    """Fill every parameter from a generator seeded with ``seed``; mutates and returns ``model``."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            v = normal(shape, 0.1, 1.0)
        elif name.endswith("attn_sink"):
            v = normal(shape, 1.0)
        elif "hc_" in name and name.endswith("_fn"):
            v = normal(shape, 0.5 / math.sqrt(shape[1]))
        elif "hc_" in name and name.endswith("_base"):
            v = normal(shape, 0.5)
        elif "hc_" in name and name.endswith("_scale"):
            v = normal(shape, 0.2, 1.0)
        elif name.endswith(("gate.bias", "gate.bias_vl")):
            v = normal(shape, 0.1)
        elif name.endswith(("q_weight", "k_weight")):
            v = normal(shape, 0.2, 1.0)
        elif name == "embed.weight" or name.endswith(("engram.embed.weight", "markov_head.embed.weight")):
            v = normal(shape, 1.0)
        elif p.dim() == 2:
            v = normal(shape, 1.0 / math.sqrt(shape[1]))
        else:
            v = normal(shape, 0.1)
        p.copy_(v.to(p.dtype))
    return model


@torch.no_grad()
def snap_to_formats(model: Transformer) -> Transformer:
    """Round every parameter to its checkpoint storage format in place (fp8 / mxfp4 / bf16 / fp32)."""
    from flashtier.engine.model.checkpoint import quantize_roundtrip

    params = dict(model.named_parameters())
    snapped = quantize_roundtrip({k: v.detach() for k, v in params.items()}, weight_formats(model))
    for name, value in snapped.items():
        params[name].copy_(value.to(params[name].dtype))
    return model


def random_model(cfg, *, seed: int = 0, dtype: torch.dtype = torch.float32, with_dspark: bool = True) -> Transformer:
    """A model with seeded random weights already snapped to the checkpoint formats.

    ``dtype=torch.float64`` gives the exactness-test mode: every parameter and all math in float64
    (see numerics.py).
    """
    model = Transformer(cfg, dtype=dtype, with_dspark=with_dspark)
    if dtype == torch.float64:
        model = model.double()
    init_random_(model, seed)
    return snap_to_formats(model).eval()
