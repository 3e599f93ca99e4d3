"""Weights in their checkpoint formats on the device: FP8 linears become ``Fp8Linear`` in place.

``quantize_linears_`` is the step between building (or loading) a model with dequantised float weights
and serving it on a GPU with the weights as stored: every FP8-format ``nn.Linear`` (``weight_formats``)
becomes an ``Fp8Linear`` (e4m3 codes + e8m0 32x32 scales, ~1.0 B/param instead of 4) on ``device``. The
MoE (``.ffn.``: routed experts, shared experts, gate) is left alone: ``moe.py`` converts its own weights.
"""

from __future__ import annotations

import torch
from torch import nn

from flashtier.engine.model.fp8_linear import Fp8Linear
from flashtier.engine.model.transformer import Transformer, weight_formats

_SKIP = (".ffn.",)


@torch.no_grad()
def quantize_linears_(model: Transformer, device: torch.device | str | None = None) -> list[str]:
    """Replace every FP8-format ``nn.Linear`` outside the MoE by an ``Fp8Linear`` on ``device``.

    Mutates ``model``: each replaced module's float weight is dropped (freed once nothing else refers to
    it); every other parameter stays where it is (move the model with ``.to(device)``; the float8 buffers
    keep their dtype). ``device=None`` keeps each weight's device. Returns the converted module names.
    Converting twice is a no-op (a converted module is no ``nn.Linear``). After conversion the model's
    ``state_dict`` holds ``<name>.weight_q`` / ``<name>.weight_scale`` instead of ``<name>.weight``.
    """
    done = []
    for name, fmt in weight_formats(model).items():
        if fmt != "fp8" or not name.endswith(".weight") or any(s in name for s in _SKIP):
            continue
        parent_name, _, attr = name.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, attr)
        if type(layer) is not nn.Linear or layer.bias is not None:
            raise ValueError(f"quantize_linears_: {name} is FP8 in the checkpoint but not a bias-free nn.Linear")
        setattr(parent, attr, Fp8Linear.from_float(layer.weight, device=device))
        done.append(f"{parent_name}.{attr}")
    return done
