"""A model on the GPU with its weights as the checkpoint stores them: no float copy of what is quantised.

    load_model_in_formats(dir, "cuda")     checkpoint shards streamed to the device tensor by tensor
    place_in_formats_(model, "cuda")       a float model (random weights made on the device) converted

FP8 linears become ``Fp8Linear`` (e4m3 codes + e8m0 32x32 scales), each MoE's routed experts (MXFP4) and shared
expert (FP8) one ``ExpertWeights``; everything else (bf16 / fp32 tensors) is dequantised into the parameter's
dtype. The Engram tables stay in host memory in their stored form (``host_engram``, default on for CUDA;
engram_offload.py), else they are dequantised like the rest. Peak extra memory while loading: one MoE layer's
stored expert bytes.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from flashtier.engine.model.checkpoint_reader import CheckpointReader, StorageFormat, dequantize
from flashtier.engine.model.dspark import dspark_skip
from flashtier.engine.model.engram import default_token_map
from flashtier.engine.model.engram_offload import TABLE_SUFFIX, attach_host_tables_, tables_to_host_, wants_host_tables
from flashtier.engine.model.engram_table import HostTable
from flashtier.engine.model.expert_weights import ExpertWeights
from flashtier.engine.model.fp8_linear import Fp8Linear
from flashtier.engine.model.loader import meta_model
from flashtier.engine.model.moe import MoE
from flashtier.engine.model.moe_convert import convert_experts_
from flashtier.engine.model.placement import quantize_linears_
from flashtier.engine.model.transformer import Transformer, weight_formats
from flashtier.kernels.quant.fp8_weight import as_e4m3fn, as_e8m0

_EXPERT = re.compile(r"^(?P<moe>.+\.ffn)\.(?:experts\.(?P<e>\d+)|shared_experts)\.(?P<w>w[123])\.weight$")


def place_in_formats_(model: Transformer, device: torch.device | str, *, host_engram: bool | None = None
                      ) -> Transformer:
    """Convert a float model in place: FP8 linears and the experts into their stored formats on ``device``,
    the Engram tables into host memory (``host_engram``: None = on for CUDA), then the rest moved there.
    Returns ``model``."""
    convert_experts_(model, device)
    quantize_linears_(model, device)
    if wants_host_tables(host_engram, device):
        tables_to_host_(model, device)
    return model.to(device)


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, nn.Parameter(value, requires_grad=False))


def _experts(moe: MoE, parts: dict[tuple[str, int], tuple], device) -> ExpertWeights:
    n = moe.gate.weight.shape[0]
    routed = {w: [parts[(w, e)] for e in range(n)] for w in ("w1", "w2", "w3")}
    shared = (parts[("w1", -1)], parts[("w3", -1)], parts[("w2", -1)])
    return ExpertWeights.from_packed(routed["w1"], routed["w3"], routed["w2"], shared, device)


@torch.no_grad()
def load_model_in_formats(
    model_dir: str | Path, device: str | torch.device, *, dtype: torch.dtype = torch.bfloat16,
    with_dspark: bool = False, progress: bool = True, host_engram: bool | None = None,
) -> Transformer:
    """Stream ``model_dir`` (official layout) onto ``device`` in the stored formats; the Engram tables into host
    memory instead (``host_engram``: None = on for CUDA), never through the device.

    Raises CheckpointError (a ValueError) before reading anything when a tensor is missing or mis-shaped.
    """
    model_dir = Path(model_dir)
    model = meta_model(model_dir, dtype, with_dspark)
    cfg = model.cfg
    formats = weight_formats(model)
    params = dict(model.named_parameters())
    expected = {k: tuple(v.shape) for k, v in params.items()}
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    pending: dict[str, dict[tuple[str, int], tuple]] = defaultdict(dict)
    reader = CheckpointReader(model_dir)
    host, tables = wants_host_tables(host_engram, device), {}
    for plan, data, scale in reader.load_stored(expected, device="cpu", progress=progress, strict=with_dspark,
                                                 skip=dspark_skip(with_dspark)):
        if host and plan.name.endswith(TABLE_SUFFIX):
            engram = model.get_submodule(plan.name.removesuffix(".embed.weight"))
            tables[engram.layer] = HostTable.from_stored(data, scale, pin=torch.device(device).type == "cuda")
            continue
        data, scale = data.to(device), None if scale is None else scale.to(device)
        hit = _EXPERT.match(plan.name)
        if hit:
            moe_name = hit["moe"]
            parts = pending[moe_name]
            parts[(hit["w"], int(hit["e"]) if hit["e"] is not None else -1)] = (data, scale)
            moe = moes[moe_name]
            if len(parts) == 3 * moe.gate.weight.shape[0] + 3:
                moe.experts, moe.shared_experts = _experts(moe, parts, device), None
                del pending[moe_name]
            continue
        if plan.fmt is StorageFormat.FP8 and formats[plan.name] == "fp8":
            owner, _, attr = plan.name.removesuffix(".weight").rpartition(".")
            setattr(model.get_submodule(owner), attr,
                    Fp8Linear(as_e4m3fn(data), as_e8m0(scale), compute_dtype=params[plan.name].dtype))
            continue
        _set_param(model, plan.name, dequantize(plan.fmt, data, scale, params[plan.name].dtype))
    if tables:
        attach_host_tables_(model, tables, device, dtype)
    model.token_map = default_token_map(cfg).to(device)
    left = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if left or pending:
        raise ValueError(f"{model_dir}: the checkpoint left {len(left)} tensors unset (e.g. {left[:3]}) and "
                         f"{len(pending)} MoE layers incomplete")
    return model.eval()
