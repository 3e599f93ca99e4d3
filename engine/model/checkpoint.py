"""Checkpoint I/O for DeepSeek-V4.1-Flash: official on-disk layout <-> dequantized float tensors by name.

The model code holds every weight dequantized under its official checkpoint name (no `model.` prefix)
and knows each tensor's storage format ("fp8", "fp8_rows", "mxfp4", "bf16", "fp32"). Reading lives in
`checkpoint_reader` (format detection from headers, lazy per-shard loading); writing in
`checkpoint_writer` (quantization, sharding, index, config). This module is the public entry point.

    write_checkpoint(dir, tensors, formats, config)
    snapped = quantize_roundtrip(tensors, formats)          # what a load will return
    for name, t in CheckpointReader(dir).load({n: tuple(t.shape) for n, t in tensors.items()}):
        ...
"""

from flashtier.engine.model.checkpoint_reader import (
    CheckpointError,
    CheckpointReader,
    StorageFormat,
    TensorInfo,
    TensorPlan,
    read_config,
)
from flashtier.engine.model.checkpoint_writer import (
    DEFAULT_MAX_SHARD_BYTES,
    quantize_roundtrip,
    write_checkpoint,
)

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "CheckpointError",
    "CheckpointReader",
    "StorageFormat",
    "TensorInfo",
    "TensorPlan",
    "quantize_roundtrip",
    "read_config",
    "write_checkpoint",
]
