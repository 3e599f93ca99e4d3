"""KV byte accounting from the actual cache tensors (allocated on the meta device: no memory, no weights)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from flashtier.engine.kv.manager import SequenceSpec
from flashtier.engine.model.config import ModelConfig
from flashtier.kvstore.layout import BlockLayout, KVGeometry, allocate_window_rings


def kv_geometry(cfg: ModelConfig) -> KVGeometry:
    return SequenceSpec.from_config(cfg, torch.float32, "meta").geometry


@dataclass(frozen=True)
class KVAccounting:
    global_bytes_per_token: float  # global KV (all streams, main + indexer K) per token
    swa_bytes_per_slot: int  # one window slot of one layer
    swa_bytes_per_sequence: int  # every layer's full window ring
    snapshot_bytes: int  # encoder rings + ratio-2 partial groups + replay tail (+ a partial tail block, not counted)
    block_size: int
    block_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def kv_accounting(cfg: ModelConfig, block_size: int = 64) -> KVAccounting:
    """Measure the cache tensors' byte sizes for ``cfg`` (meta tensors; nothing is allocated)."""
    geo = kv_geometry(cfg)
    layout = BlockLayout(geo, block_size)
    pool = layout.allocate(1, device="meta")
    rings = allocate_window_rings(geo, device="meta")
    per_layer_ring = rings[0].numel() * rings.element_size()
    n_partial = sum(1 for r in geo.source_ratios if r == 2)
    # a ratio-2 partial group: one token's fp32 kv row and fp32 gate-score row
    partial_bytes = n_partial * 2 * cfg.head_dim * 4
    # the replay tail: fp32 encoder outputs x [window, hc, D] and pre [window, hc] (snapshot_codec)
    replay_tail_bytes = cfg.sliding_window * cfg.hc_mult * (cfg.hidden_size + 1) * 4
    gbpt = pool.numel() * pool.element_size() / block_size
    return KVAccounting(
        global_bytes_per_token=int(gbpt) if gbpt == int(gbpt) else gbpt,
        swa_bytes_per_slot=rings.shape[-1],
        swa_bytes_per_sequence=rings.numel() * rings.element_size(),
        snapshot_bytes=geo.n_encoder_window_layers * per_layer_ring + partial_bytes + replay_tail_bytes,
        block_size=block_size,
        block_bytes=pool.numel() * pool.element_size(),
    )
