"""A checkpoint's logical tensors without their data: name, storage format, logical shape, stored bytes.

Two sources give the same ``Inventory`` (tests/engine/test_memory_plan.py checks they agree byte for byte):

    inventory_from_config(cfg)        the official layout (model.md §4) spelled out from the geometry alone:
                                      milliseconds for V4.1-Flash's 48k tensors (a meta-device Transformer
                                      takes seconds to build its 46k expert modules)
    inventory_from_checkpoint(dir)    the shard headers only (CheckpointReader reads no tensor data): what
                                      the files on disk really hold, vision weights left out

Stored bytes of one logical tensor ``[N, K]`` by format (checkpoint_reader.py's table)::

    fp8        N*K e4m3 + ceil(N/32)*ceil(K/32) e8m0      one scale per 32x32 block
    fp8_rows   N*K e4m3 + N*ceil(K/32) e8m0               one scale per 1x32 row block (Engram tables)
    mxfp4      N*K/2 e2m1 pairs + N*K/32 e8m0             one scale per 32 values of a row
    bf16/fp32  numel * 2 / numel * 4
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from flashtier.engine.model.checkpoint import CheckpointReader, StorageFormat
from flashtier.engine.model.config import ModelConfig, from_hf_dict
from flashtier.engine.model.checkpoint import read_config
from flashtier.engine.model.engram import engram_table_rows

# bytes per element of the safetensors dtype tags a checkpoint may hold
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "BF16": 2, "F16": 2,
               "I16": 2, "F32": 4, "I32": 4, "U32": 4, "F64": 8, "I64": 8, "U64": 8}
_VISION = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


class Part:
    """What a tensor is for: the plan's rows (plain strings, so a report can print them as they are)."""

    ROUTED = "routed experts"
    SHARED = "shared experts"
    ATTENTION = "attention"
    VOCAB = "embedding + head"
    ENGRAM_TABLE = "engram tables"
    OTHER = "other dense"

    ORDER = (ROUTED, SHARED, ATTENTION, VOCAB, OTHER, ENGRAM_TABLE)


def part_of(name: str) -> str:
    """The ``Part`` of checkpoint tensor ``name``."""
    if ".ffn.experts." in name:
        return Part.ROUTED
    if ".ffn.shared_experts." in name:
        return Part.SHARED
    if name.endswith("engram.embed.weight"):
        return Part.ENGRAM_TABLE
    if name in ("embed.weight", "head.weight"):
        return Part.VOCAB
    if ".attn." in name:
        return Part.ATTENTION
    return Part.OTHER


def stored_bytes(fmt: StorageFormat | None, shape: tuple[int, ...], plain_bytes: int = 2) -> int:
    """Bytes on disk of one logical tensor (codes and scale together); ``plain_bytes`` is the element size of an
    unquantised tensor whose format is None (an integer table)."""
    numel = math.prod(shape)
    if fmt is StorageFormat.FP8:
        n, k = shape
        return numel + math.ceil(n / 32) * math.ceil(k / 32)
    if fmt is StorageFormat.FP8_ROWS:
        n, k = shape
        return numel + n * math.ceil(k / 32)
    if fmt is StorageFormat.MXFP4:
        n, k = shape
        return numel // 2 + n * (k // 32)
    if fmt is StorageFormat.FP32:
        return numel * 4
    if fmt is StorageFormat.BF16:
        return numel * 2
    return numel * plain_bytes


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One logical tensor of the checkpoint (a quantised weight counts its ``.scale`` sibling)."""

    name: str  # official name, e.g. layers.3.ffn.experts.17.w2.weight
    fmt: StorageFormat | None  # None: an unquantised dtype other than bf16 / fp32 (integer tables)
    shape: tuple[int, ...]  # logical (dequantised) shape
    nbytes: int  # bytes on disk

    @property
    def part(self) -> str:
        return part_of(self.name)


@dataclass(frozen=True, slots=True)
class Inventory:
    """Every logical tensor of a model in checkpoint order, and where the list came from."""

    config: ModelConfig
    tensors: tuple[TensorSpec, ...]
    source: str  # "preset v4.1-flash" or "checkpoint DIR"
    with_dspark: bool  # the DSpark stages (mtp.*) are listed

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}


def _spec(name: str, fmt: StorageFormat, *shape: int) -> TensorSpec:
    return TensorSpec(name, fmt, tuple(shape), stored_bytes(fmt, tuple(shape)))


def _block(cfg: ModelConfig, prefix: str, role: str, ratio: int, engram_rows: int | None,
           n_experts: int) -> list[TensorSpec]:
    """One block's tensors (a backbone layer, or a DSpark stage with ``role`` "swa"), as Block builds them."""
    F8, BF, F32, MX = StorageFormat.FP8, StorageFormat.BF16, StorageFormat.FP32, StorageFormat.MXFP4
    d, hd, h, g = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.o_groups
    n_mix = (2 + cfg.hc_mult) * cfg.hc_mult
    out = []
    for sub in ("attn", "ffn"):
        out += [_spec(f"{prefix}hc_{sub}_fn", F32, n_mix, cfg.hc_mult * d), _spec(f"{prefix}hc_{sub}_base", F32, n_mix),
                _spec(f"{prefix}hc_{sub}_scale", F32, 3)]
    a = f"{prefix}attn."
    out += [_spec(f"{prefix}attn_norm.weight", F32, d), _spec(f"{a}attn_sink", F32, h),
            _spec(f"{a}wq_a.weight", F8, cfg.q_lora_rank, d), _spec(f"{a}q_norm.weight", F32, cfg.q_lora_rank),
            _spec(f"{a}wq_b.weight", F8, h * hd, cfg.q_lora_rank), _spec(f"{a}wkv.weight", F8, hd, d),
            _spec(f"{a}kv_norm.weight", F32, hd), _spec(f"{a}wo_a.weight", F8, g * cfg.o_lora_rank, h * hd // g),
            _spec(f"{a}wo_b.weight", F8, d, g * cfg.o_lora_rank)]
    if role == "full":  # the KV source's compressor (a gate at ratio 2 only)
        out.append(_spec(f"{a}compressor.wkv.weight", BF, hd, d))
        if ratio == 2:
            out.append(_spec(f"{a}compressor.wgate.weight", BF, hd, d))
        out.append(_spec(f"{a}compressor.norm.weight", F32, hd))
    if role in ("full", "reindex"):  # an indexer query; its own keys only at a KV source
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        out += [_spec(f"{a}indexer.wq_b.weight", F8, ih * idim, cfg.q_lora_rank),
                _spec(f"{a}indexer.weights_proj.weight", BF, ih, d)]
        if role == "full":
            out += [_spec(f"{a}indexer.wk.weight", BF, idim, hd), _spec(f"{a}indexer.k_norm.weight", F32, idim)]
    f, inter = f"{prefix}ffn.", cfg.moe_intermediate_size
    out += [_spec(f"{prefix}ffn_norm.weight", F32, d), _spec(f"{f}gate.weight", BF, n_experts, d),
            _spec(f"{f}gate.bias", F32, n_experts), _spec(f"{f}gate.bias_vl", F32, n_experts)]
    for e in range(n_experts):
        out += [_spec(f"{f}experts.{e}.w1.weight", MX, inter, d), _spec(f"{f}experts.{e}.w2.weight", MX, d, inter),
                _spec(f"{f}experts.{e}.w3.weight", MX, inter, d)]
    s = inter * cfg.n_shared_experts
    out += [_spec(f"{f}shared_experts.w1.weight", F8, s, d), _spec(f"{f}shared_experts.w2.weight", F8, d, s),
            _spec(f"{f}shared_experts.w3.weight", F8, s, d)]
    if engram_rows is not None:
        e = f"{prefix}engram."
        out += [_spec(f"{e}q_weight", F32, cfg.hc_mult, d), _spec(f"{e}k_weight", F32, cfg.hc_mult, d),
                _spec(f"{e}embed.weight", StorageFormat.FP8_ROWS, engram_rows, cfg.engram_head_dim),
                _spec(f"{e}wkv.weight", F8, (cfg.hc_mult + 1) * d, cfg.engram_n_hashes * cfg.engram_head_dim)]
    return out


def inventory_from_config(cfg: ModelConfig, *, with_dspark: bool = False, source: str | None = None) -> Inventory:
    """The official checkpoint's logical tensors for ``cfg`` (``with_dspark``: the ``mtp.*`` stages too).

    Pure: reads no file and allocates no tensor. ValueError from ``cfg.layer_roles()`` on an inconsistent
    layer layout."""
    BF, F32 = StorageFormat.BF16, StorageFormat.FP32
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [_spec("embed.weight", BF, v, d)]
    engram = set(cfg.engram_layer_ids)
    for role in cfg.layer_roles():
        rows = engram_table_rows(cfg, role.index) if role.index in engram else None
        out += _block(cfg, f"layers.{role.index}.", role.role, role.ratio, rows, cfg.n_routed_experts)
    out += [_spec("norm.weight", F32, d), _spec("head.weight", BF, v, d)]
    n_mtp = cfg.num_nextn_predict_layers if with_dspark else 0
    for i in range(n_mtp):
        p = f"mtp.{i}."
        out += _block(cfg, p, "swa", 0, None, cfg.dspark_n_routed_experts)
        if i == 0:
            out += [_spec(f"{p}main_proj.weight", StorageFormat.FP8, d, len(cfg.dspark_target_layer_ids) * d),
                    _spec(f"{p}main_norm.weight", F32, d)]
        if i == n_mtp - 1:
            r = cfg.dspark_markov_rank
            out += [_spec(f"{p}norm.weight", F32, d), _spec(f"{p}markov_head.embed.weight", BF, v, r),
                    _spec(f"{p}markov_head.head.weight", BF, v, r),
                    _spec(f"{p}confidence_head.proj.weight", F32, 1, d + r)]
    return Inventory(cfg, tuple(out), source or f"preset {cfg.name}", with_dspark)


def inventory_from_checkpoint(directory: str | Path, *, with_dspark: bool = False) -> Inventory:
    """The logical tensors a checkpoint directory holds, from its config.json, index and shard headers only.

    Vision weights are left out (the text model never reads them), so are ``mtp.*`` without ``with_dspark``.
    Raises CheckpointError (a ValueError) for an unreadable directory or an inconsistent weight / scale pair.
    """
    reader = CheckpointReader(directory)
    cfg = from_hf_dict(read_config(directory), name=str(directory))
    out = []
    scales = set()
    for name in reader.tensors:
        if name.startswith(_VISION) or (not with_dspark and name.startswith("mtp.")):
            continue
        plan = reader.plan(name)
        if plan.scale is not None:
            scales.add(plan.scale.name)
    for name, info in reader.tensors.items():
        if name in scales or name.startswith(_VISION) or (not with_dspark and name.startswith("mtp.")):
            continue
        plan = reader.plan(name)
        nbytes = math.prod(info.shape) * DTYPE_BYTES[info.dtype]
        if plan.scale is not None:
            nbytes += math.prod(plan.scale.shape) * DTYPE_BYTES[plan.scale.dtype]
        out.append(TensorSpec(name, plan.fmt, tuple(plan.shape), nbytes))
    return Inventory(cfg, tuple(out), f"checkpoint {directory}", with_dspark)
