"""Build a model from a checkpoint directory (official layout) or write one from a model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from flashtier.engine.model.checkpoint import CheckpointReader, write_checkpoint
from flashtier.engine.model.config import ModelConfig, from_hf_dict, preset
from flashtier.engine.model.dspark import dspark_skip
from flashtier.engine.model.engram import default_token_map
from flashtier.engine.model.init import random_model, to_empty
from flashtier.engine.model.transformer import Transformer, weight_formats

log = logging.getLogger("flashtier.engine.model")


def save_model(model: Transformer, directory: str | Path, *, max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` in the official checkpoint layout (shards + index + config.json)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    cfg = model.cfg.to_hf_dict()
    cfg["_flashtier_preset"] = model.cfg.name
    kw = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    write_checkpoint(directory, params, weight_formats(model), cfg, **kw)
    return Path(directory)


def meta_model(model_dir: Path, dtype: torch.dtype, with_dspark: bool) -> Transformer:
    """The model ``model_dir/config.json`` describes, on the meta device (no storage yet)."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{model_dir} has no config.json: not a model directory")
    cfg = from_hf_dict(json.loads(cfg_path.read_text()), name=str(model_dir))
    with torch.device("meta"):
        return Transformer(cfg, dtype=dtype, with_dspark=with_dspark)


@torch.no_grad()
def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_dspark: bool = True,
    progress: bool = True,
) -> Transformer:
    """Read config.json and the safetensors shards of ``model_dir`` into a new model.

    Raises CheckpointError (a ValueError) naming any missing or mis-shaped tensor.
    """
    model_dir = Path(model_dir)
    model = meta_model(model_dir, dtype, with_dspark)
    cfg = model.cfg
    model = to_empty(model, device)
    model.token_map = default_token_map(cfg).to(device)  # the meta buffer has no values
    params = dict(model.named_parameters())
    expected = {k: tuple(v.shape) for k, v in params.items()}
    # without the drafter the official layout's mtp.* tensors are left unread without a word
    reader = CheckpointReader(model_dir)
    for name, tensor in reader.load(expected, dtype=torch.float32, device=device, progress=progress,
                                    strict=with_dspark, skip=dspark_skip(with_dspark)):
        params[name].copy_(tensor.to(params[name].dtype))
    return model.eval()


def demo_checkpoint(cache_dir: str | Path, name: str = "tiny", seed: int = 0) -> Path:
    """The demo model directory under ``cache_dir`` (seeded random weights), created when missing."""
    target = Path(cache_dir) / f"demo-{name}-seed{seed}"
    if (target / "config.json").is_file():
        return target
    log.info("creating the demo %s checkpoint (seeded random weights) in %s", name, target)
    cfg: ModelConfig = preset(name)
    save_model(random_model(cfg, seed=seed), target)
    return target
