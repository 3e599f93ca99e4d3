"""Write dequantized model weights as a checkpoint in the official DeepSeek-V4.1 layout (model.md §4).

Output in `directory`:
  model-00001-of-0000N.safetensors ...   quantized per format; a weight and its `.scale` share a shard
  model.safetensors.index.json           {"metadata": {"total_size": bytes}, "weight_map": {name: shard}}
  config.json                            the given dict, indent 2

Every file is written under a temporary name and renamed into place, shards first, then the index (the
commit point: a reader never sees an index naming a half-written shard), then config.json. Shards of an
earlier write that the new index no longer names are removed afterwards.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashtier.engine.model.checkpoint_reader import (
    CONFIG_FILE,
    FP8_BLOCK,
    FP8_ROWS_BLOCK,
    INDEX_FILE,
    MXFP4_GROUP,
    CheckpointError,
    StorageFormat,
    dequantize,
    scale_name,
)
from flashtier.kernels.quant.fp8_weight import quantize_fp8_weight
from flashtier.kernels.quant.mxfp4 import quantize_mxfp4

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def quantize_tensor(
    name: str, tensor: torch.Tensor, fmt: StorageFormat | str, *, on_device: bool = False
) -> dict[str, torch.Tensor]:
    """One logical tensor -> its stored tensor(s): `{NAME: data}` or `{NAME: codes, PREFIX.scale: scale}`.

    On the CPU (for writing) unless ``on_device``: then where ``tensor`` lives (the kernels' GPU paths)."""
    fmt = StorageFormat(fmt)
    t = tensor.detach() if on_device else tensor.detach().to("cpu")
    if not fmt.quantized:
        # A fresh contiguous copy: safetensors refuses tensors that share storage (views of stacked weights).
        out_dtype = torch.bfloat16 if fmt is StorageFormat.BF16 else torch.float32
        return {name: torch.empty(t.shape, dtype=out_dtype, device=t.device).copy_(t)}
    if t.dim() != 2:
        raise CheckpointError(f"{name}: {fmt.value} needs a 2-D [N, K] weight, got shape {list(t.shape)}")
    if fmt is StorageFormat.MXFP4:
        if t.shape[1] % MXFP4_GROUP:
            raise CheckpointError(f"{name}: mxfp4 needs K divisible by {MXFP4_GROUP}, got shape {list(t.shape)}")
        packed, scales = quantize_mxfp4(t.float())
        # Official dtypes: I8 for the packed e2m1 pairs, F8_E8M0 for the exponents (same bytes, other view).
        return {name: packed.view(torch.int8), scale_name(name): scales.view(torch.float8_e8m0fnu)}
    block = FP8_BLOCK if fmt is StorageFormat.FP8 else FP8_ROWS_BLOCK
    codes, scales = quantize_fp8_weight(t.float(), block=block)
    return {name: codes, scale_name(name): scales}


def _formats(tensors: Mapping[str, torch.Tensor], formats: Mapping[str, str]) -> dict[str, StorageFormat]:
    """Validate names and formats together: every tensor has a known format and no stored names collide."""
    out = {}
    for name in tensors:
        if name not in formats:
            raise CheckpointError(f"{name}: no storage format given (one of {[f.value for f in StorageFormat]})")
        try:
            out[name] = StorageFormat(formats[name])
        except ValueError:
            raise CheckpointError(
                f"{name}: unknown storage format {formats[name]!r}; use one of {[f.value for f in StorageFormat]}"
            ) from None
        if out[name].quantized and scale_name(name) in tensors:
            raise CheckpointError(f"{name}: its {out[name].value} scale would overwrite tensor {scale_name(name)}")
    return out


def quantize_roundtrip(
    tensors: Mapping[str, torch.Tensor], formats: Mapping[str, str], *, dtype: torch.dtype = torch.float32,
    on_device: bool = False,
) -> dict[str, torch.Tensor]:
    """The values `CheckpointReader.load(dtype=dtype)` will return for these tensors once written.

    Lets a caller snap its in-memory weights to exactly what the checkpoint will hold (``on_device``: computed
    where the tensors live, e.g. a model made on the GPU; else on the CPU).
    """
    fmts = _formats(tensors, formats)
    out = {}
    for name, tensor in tensors.items():
        stored = quantize_tensor(name, tensor, fmts[name], on_device=on_device)
        scale = stored[scale_name(name)] if fmts[name].quantized else None
        out[name] = dequantize(fmts[name], stored[name], scale, dtype)
    return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _replace_json(path: Path, obj: object, **kwargs) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with open(tmp, "w") as f:
        json.dump(obj, f, **kwargs)
        f.write("\n")
    os.replace(tmp, path)


def write_checkpoint(
    directory: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    formats: Mapping[str, str],
    config: dict,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Quantize `tensors` per `formats`, write shards + index + config.json; return the shard file names.

    Shards are filled greedily in `tensors` order and close before a tensor group (weight + scale) would
    push them past `max_shard_bytes`; a single group larger than the limit gets a shard of its own.
    Only one shard's quantized tensors are held in memory at a time.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fmts = _formats(tensors, formats)
    tmp_prefix = f".tmp-{os.getpid()}-shard-"
    written: list[tuple[Path, list[str]]] = []  # (temporary path, stored names) per shard
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0

    def flush() -> None:
        tmp = directory / f"{tmp_prefix}{len(written) + 1:05d}.safetensors"
        written.append((tmp, list(pending)))
        save_file(pending, str(tmp), metadata={"format": "pt"})

    try:
        for name, tensor in tensors.items():
            group = quantize_tensor(name, tensor, fmts[name])
            nbytes = sum(_nbytes(t) for t in group.values())
            if pending and pending_bytes + nbytes > max_shard_bytes:
                flush()
                pending, pending_bytes = {}, 0
            pending.update(group)
            pending_bytes += nbytes
            total_bytes += nbytes
        if pending or not written:
            flush()
        n = len(written)
        shard_names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map = {name: shard for (_, names), shard in zip(written, shard_names) for name in names}
        for (tmp, _), shard in zip(written, shard_names):
            os.replace(tmp, directory / shard)
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        _replace_json(directory / INDEX_FILE, index, indent=2)
        _replace_json(directory / CONFIG_FILE, config, indent=2)
    finally:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
    for stale in directory.iterdir():
        if _SHARD_RE.fullmatch(stale.name) and stale.name not in shard_names:
            stale.unlink()
    return shard_names
