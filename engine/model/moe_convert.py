"""Put a model's MoE experts on a device in their checkpoint formats: the GPU engine's expert form.

    convert_experts_(model, "cuda")     # before moving the rest of the model: experts never exist there in float

Every ``MoE`` in the model (backbone layers and DSpark stages) gets an ``ExpertWeights`` (routed experts in
MXFP4, shared expert in FP8) built from its float experts on the device, and drops the float ones. From
then on its forward runs the kernels (``engine/model/moe.py``). Lossless for weights snapped to the
checkpoint formats (``init.snap_to_formats``, or any loaded checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn

from flashtier.engine.model.expert_weights import ExpertWeights
from flashtier.engine.model.moe import MoE


@torch.no_grad()
def convert_experts_(model: nn.Module, device: torch.device | str) -> int:
    """Replace each MoE's ``experts`` (and ``shared_experts``) of ``model`` by an ``ExpertWeights`` on ``device``.

    Mutates ``model`` in place and returns the bytes now resident for experts. Already converted layers are
    left as they are. The float expert modules are released as each layer is converted, so the peak extra
    memory is one layer's float experts (where they already were) plus one weight matrix in fp32 on the
    device. Raises ValueError if a layer's experts have inconsistent shapes.
    """
    total = 0
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        if not moe.converted:
            moe.experts = ExpertWeights.from_float(moe.experts, moe.shared_experts, device)
            moe.shared_experts = None
        total += moe.experts.nbytes
    return total
