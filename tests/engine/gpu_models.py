"""Models for the GPU tests: tiny at the real index width (128) so the Triton indexer runs."""

import dataclasses

import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.init import random_model, random_model_on_device


def tiny_on_cuda(formats: str, seed: int = 3, with_dspark: bool = False):
    """"float32": float weights (the experts' reference loop); "checkpoint": bf16 with FP8 linears, MXFP4 routed
    experts and an FP8 shared expert (the kernels a real checkpoint runs). ``with_dspark``: the drafter's stages
    too (checkpoint formats only)."""
    cfg = dataclasses.replace(preset("tiny"), index_head_dim=128)
    if formats == "float32":
        return random_model(cfg, seed=seed, dtype=torch.float32).cuda()
    from flashtier.engine.model.moe_convert import convert_experts_
    from flashtier.engine.model.placement import quantize_linears_

    model = random_model_on_device(cfg, "cuda", dtype=torch.bfloat16, with_dspark=with_dspark)
    quantize_linears_(model, "cuda")
    convert_experts_(model, "cuda")
    return model
