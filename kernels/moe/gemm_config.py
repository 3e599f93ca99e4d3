"""Launch configs of the grouped MoE GEMM, one per weight shape and device, from a table a tuning run fills.

    config_for(n_rows, k, "mxfp4", device_name) -> MoEGemmConfig

The key is the routed weight matrix of the projection (w13 ``[2I, D]``: n_rows = 2I, k = D; w2 ``[D, I]``), its
format and ``torch.cuda.get_device_name()``; the batch size is deliberately not part of it: ``split_k`` and
``block_k`` fix a row's summation order, so keying them by batch would break batch invariance. The shared
expert rides in the same launch with the same config.

The table is ``gemm_configs.json`` beside this module (checked in; ``benchmarks/moe_bench.py --tune-out``
writes one from timings on the device), overridden entry by entry by the file named in the environment
variable ``FLASHTIER_MOE_GEMM_CONFIGS`` if set (a cache dir of one's own tuning). Missing entries get
``DEFAULT``: a safe config (any shape, any CUDA device). The file is read once per process; a malformed
entry raises ValueError naming the file.

    {"entries": [{"device": "NVIDIA H100 80GB HBM3", "format": "mxfp4", "n": 4608, "k": 5120,
                  "config": {"block_n": 64, "block_k": 128, "sub_tiles": 4, "num_warps": 4, ...},
                  "note": "benchmarks/moe_bench.py --tune ..., 1 / 8 / 64 tokens: ..."}]}
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from flashtier.kernels.moe.grouped_gemm_kernel import MoEGemmConfig

TABLE = Path(__file__).with_name("gemm_configs.json")
ENV_TABLE = "FLASHTIER_MOE_GEMM_CONFIGS"
DEFAULT = MoEGemmConfig()


@dataclass(frozen=True)
class ConfigKey:
    """What a config is chosen by: the routed weight matrix's shape and format, and the device's name."""

    device: str
    format: str  # "mxfp4"
    n: int  # rows of the stored weight matrix (w13: 2I, w2: D)
    k: int  # reduction length (w13: D, w2: I)


@dataclass(frozen=True)
class MoEFfnConfig:
    """The two launches of ``moe_grouped_ffn``: w1 + w3 (gated) and w2, each its own config."""

    w13: MoEGemmConfig = DEFAULT
    w2: MoEGemmConfig = DEFAULT


def _read(path: Path) -> dict[ConfigKey, MoEGemmConfig]:
    try:
        doc = json.loads(path.read_text())
        table = {}
        for entry in doc["entries"]:
            key = ConfigKey(str(entry["device"]), str(entry["format"]), int(entry["n"]), int(entry["k"]))
            table[key] = MoEGemmConfig(**entry["config"])
        return table
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"moe gemm config table {path}: {exc}") from exc


@functools.lru_cache(maxsize=1)
def _table() -> dict[ConfigKey, MoEGemmConfig]:
    table = _read(TABLE) if TABLE.is_file() else {}
    override = os.environ.get(ENV_TABLE)
    if override:
        table.update(_read(Path(override)))
    return table


def config_for(n: int, k: int, fmt: str, device_name: str) -> MoEGemmConfig:
    """The tuned config of a ``[n, k]`` weight matrix in ``fmt`` on ``device_name``, else ``DEFAULT``."""
    return _table().get(ConfigKey(device_name, fmt, n, k), DEFAULT)


def table_entry(key: ConfigKey, config: MoEGemmConfig, note: str) -> dict:
    """One JSON entry of the table (what ``--tune-out`` writes)."""
    return dict(device=key.device, format=key.format, n=key.n, k=key.k, config=dataclasses.asdict(config),
                note=note)
