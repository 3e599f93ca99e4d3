"""Build an ``Engine`` from the package configs (which server/config/settings.py builds); the engine-core
process (engine/parallel/rank_worker.py) and the offline ``LLM`` call it."""

from __future__ import annotations

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.config import preset
from flashtier.engine.model.device_loader import load_model_in_formats, place_in_formats_
from flashtier.engine.model.engram import Engram
from flashtier.engine.model.init import random_model, random_model_on_device
from flashtier.engine.model.loader import load_model
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.config import KVStoreConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def build_model(config: EngineConfig) -> Transformer:
    """The checkpoint in ``config.model_dir``, else the preset with seeded random weights.

    On CUDA (bf16 / fp32) the weights stay in their checkpoint formats (FP8 linears, MXFP4 experts) and are
    made or streamed on the device; float64 and the CPU keep float weights (the reference path).
    """
    dtype = _DTYPES[config.dtype]
    device = torch.device(config.device)
    dspark = config.speculative_tokens > 0  # the drafter stages are only built when speculation is on
    if device.type == "cuda" and dtype != torch.float64:
        if config.model_dir is not None:
            return load_model_in_formats(config.model_dir, device, dtype=dtype, with_dspark=dspark, progress=False)
        model = random_model_on_device(preset(config.preset), device, seed=config.weights_seed, dtype=dtype,
                                       with_dspark=dspark)
        return place_in_formats_(model, device)
    if config.model_dir is not None:
        model = load_model(config.model_dir, dtype=dtype, device=config.device, with_dspark=dspark, progress=False)
        if dtype == torch.float64:
            model = model.double()
        return model
    return random_model(preset(config.preset), seed=config.weights_seed, dtype=dtype, with_dspark=dspark).to(
        config.device
    )


def reserve_engram_staging(model: Transformer, tokens: int) -> None:
    """Size the host Engram tables' pinned staging for a full step now (a first large step would otherwise grow
    it with a sync). No-op when the tables are on the device."""
    for module in model.modules():
        if isinstance(module, Engram) and module.host is not None:
            module.host.reserve(tokens)  # one HostEngramTables serves every Engram layer
            return


def build_engine(
    config: EngineConfig,
    kv_config: KVStoreConfig | None = None,
    token_map: torch.Tensor | None = None,
    *,
    tiers: bool = False,
) -> Engine:
    """``tiers``: attach a ``TierManager`` (SSD tier when ``kv_config.ssd_dir`` is set, snapshot pool:
    Redis when ``redis_url`` is set, else the embedded pool)."""
    model = build_model(config)
    reserve_engram_staging(model, config.max_num_batched_tokens)
    if token_map is not None:
        model.set_token_map(token_map.to(model.device))
    kv_config = kv_config or KVStoreConfig()
    return Engine(model, config, kv_config, TierManager(kv_config) if tiers else None)
