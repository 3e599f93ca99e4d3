"""The model: configuration, the official checkpoint layout (reader, writer, loaders), the layers and the
reference, incremental, batched and paged forwards.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = [
    "attention", "batch_attention", "batch_forward", "checkpoint", "compressor", "config", "dense_entries", "device_loader",
    "dspark", "engram", "engram_host", "engram_offload", "engram_table", "incremental", "init", "layer_forward", "loader", "mhc", "moe",
    "numerics", "paged_forward", "sharded_reader", "step_rows", "transformer",
]
