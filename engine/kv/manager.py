"""KVManager: the scheduler's view of KV memory — block ids (BlockPool), their bytes (GlobalKVPool) and
the per-sequence state it creates (``PagedSequence``).

    scheduler ──ensure_blocks / free / match_prefix / cache_full_blocks──▶ KVManager ──▶ BlockPool (ids)
                                                                              └────────▶ GlobalKVPool (bytes)
Built from a ``SequenceSpec`` (geometry only), so a scheduler with a small pool can be tested without
a model. Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashtier.engine.kv.block_table import BlockTable
from flashtier.engine.model.config import ModelConfig
from flashtier.engine.kv.paged_entries import PagedEntries
from flashtier.engine.kv.paged_kv import PagedSequence
from flashtier.engine.kv.ring_arena import RingArena
from flashtier.engine.kv.window_rings import WindowRings
from flashtier.kvstore.block_hash import BlockHash, fork_root, hash_block
from flashtier.kvstore.block_pool import BlockPool, KVBlock, TenantDrop
from flashtier.kvstore.kv_pool import GlobalKVPool
from flashtier.kvstore.layout import BlockLayout, KVGeometry

if TYPE_CHECKING:  # only annotations: engine.request pulls in the grammar stack (xgrammar, transformers: ~2 s)
    from flashtier.engine.core.request import Sequence


@dataclass(frozen=True)
class SequenceSpec:
    """What a new sequence's KV state looks like (from the model config; no weights)."""

    source_layer_ids: tuple[int, ...]  # KV source layers, in stream order
    source_ratios: tuple[int, ...]  # their compression ratios (tokens per entry)
    n_layers: int
    n_encoder_layers: int
    window: int
    head_dim: int
    index_head_dim: int
    dtype: torch.dtype  # compute dtype of dequantised reads
    device: torch.device
    stream_shape: tuple[int, int]  # (hc_mult, hidden_size): one encoder output row, the decoder replay's input

    @staticmethod
    def from_config(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> SequenceSpec:
        ids = tuple(cfg.kv_source_layer_ids)
        return SequenceSpec(ids, tuple(cfg.compress_ratios[s] for s in ids), cfg.num_hidden_layers,
                            cfg.n_encoder_layers, cfg.sliding_window, cfg.head_dim, cfg.index_head_dim,
                            dtype, torch.device(device), (cfg.hc_mult, cfg.hidden_size))

    @property
    def geometry(self) -> KVGeometry:
        return KVGeometry(head_dim=self.head_dim, index_head_dim=self.index_head_dim,
                          source_ratios=self.source_ratios, window=self.window, n_window_layers=self.n_layers,
                          n_encoder_window_layers=self.n_encoder_layers)

    @property
    def partial_order(self) -> list[int]:
        """Ratio-2 sources, in stream order: they carry a partial group between steps."""
        return [s for s, r in zip(self.source_layer_ids, self.source_ratios) if r == 2]


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """A block that became full and was registered in the prefix index (write-through candidate)."""

    block_id: int
    block_hash: BlockHash


class KVManager:
    """Block accounting and byte pool of one engine. Every method mutates only what it names."""

    def __init__(self, spec: SequenceSpec, layout: BlockLayout, num_blocks: int, *, enable_caching: bool = True,
                 ring_slots: int = 0):
        """``layout``: ``BlockLayout(spec.geometry, block_size)`` (the caller sized ``num_blocks`` by it);
        ``ring_slots`` > 0: new sequences keep their window rings in a ``RingArena`` of that many slots."""
        self.spec = spec
        self.arena = (RingArena(spec.n_layers, spec.window, spec.head_dim, ring_slots, spec.device)
                      if ring_slots else None)
        self.block_size = layout.block_size
        self.layout = layout
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.kv = GlobalKVPool(self.layout, num_blocks, spec.device)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def new_kv(self) -> PagedSequence:
        """An empty KV state (no blocks). Mutates nothing."""
        s = self.spec
        table = BlockTable(device=s.device)
        per_block = self.layout.entries_per_block
        stores = {
            src: PagedEntries(self.kv, i, per_block[i], s.source_ratios[i], table, s.head_dim, s.index_head_dim,
                              s.dtype)
            for i, src in enumerate(s.source_layer_ids)
        }
        rings = WindowRings(s.n_layers, s.window, s.head_dim, s.dtype, s.device, self.arena)
        return PagedSequence(table=table, stores=stores, rings=rings, partial={src: None for src in s.partial_order})

    def ensure_blocks(self, kv: PagedSequence, upto_position: int) -> bool:
        """Grow ``kv.table`` to hold positions < ``upto_position``.

        Mutates: the pool and the table. Failure: False when the pool is short; nothing is allocated.
        """
        need = -(-upto_position // self.block_size) - len(kv.table)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        for b in blocks:
            kv.table.append(b.block_id)
        return True

    def allocate(self, n: int) -> list[KVBlock] | None:
        """``n`` fresh blocks (ref 1) or None when the pool is short (nothing allocated)."""
        return self.pool.allocate(n) if n else []

    def blocks(self, ids: list[int]) -> list[KVBlock]:
        return [self.pool.blocks[i] for i in ids]

    def pin(self, ids: list[int]) -> None:
        """Take one more reference on each block (prefix hits, forks). Mutates ref counts / LRU."""
        self.pool.touch(self.blocks(ids))

    def release(self, ids: list[int]) -> None:
        """Drop one reference on each block; full cached ones stay in the prefix index (LRU)."""
        self.pool.free(self.blocks(ids))

    def free(self, kv: PagedSequence) -> None:
        """Release every block of ``kv`` and empty its table."""
        self.release(kv.table.ids)
        kv.table.replace([])

    def match_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """Block ids of the longest cached run of ``hashes`` (counted in the pool's stats; not pinned)."""
        return [b.block_id for b in self.pool.match_prefix(hashes)]

    def load_block(self, block_id: int, image: bytes, block_hash: BlockHash, tenant: bytes | None = None) -> None:
        """Fill a fresh block with a full block's image and register its hash for ``tenant`` (SSD loads)."""
        self.kv.load_image(block_id, image)
        self.pool.cache_full_block(self.pool.blocks[block_id], block_hash, tenant)

    def drop_tenant(self, tenant: bytes) -> TenantDrop:
        """``BlockPool.drop_tenant``: the tenant's cached blocks leave the prefix index (blocks in use stay
        with their requests, unhashed). Engine thread only; mutates the index, never bytes or ref counts."""
        return self.pool.drop_tenant(tenant)

    def cache_full_blocks(self, seq: Sequence, namespace: BlockHash) -> list[CachedBlock]:
        """Hash and register every block of ``seq`` that became full since the last call.

        Provenance: a block holding an entry computed from a replayed (approximate) window state, at or
        after ``seq.kv.replayed_from``, is hashed on the replayed fork (``fork_root``) when the chain has
        not forked yet, so exact lookups never find it and lookups that follow the fork do.

        Each block registered carries ``seq.tenant`` (``BlockPool.drop_tenant`` finds it by that tag).

        Mutates: ``seq.hashes``, ``seq.fork_block`` and the prefix index. Returns the blocks registered.
        """
        bs, tokens = self.block_size, seq.kv.tokens
        replayed_from = seq.kv.replayed_from
        new = []
        while (len(seq.hashes) + 1) * bs <= len(tokens) and len(seq.hashes) < len(seq.kv.table):
            k = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else namespace
            if seq.fork_block is None and replayed_from is not None and (k + 1) * bs > replayed_from:
                parent, seq.fork_block = fork_root(parent), k
            h = hash_block(parent, tokens[k * bs : (k + 1) * bs])
            seq.hashes.append(h)
            block_id = seq.kv.table.ids[k]
            self.pool.cache_full_block(self.pool.blocks[block_id], h, seq.tenant)
            new.append(CachedBlock(block_id, h))
        return new

    def image(self, block_id: int) -> bytes:
        return self.kv.image(block_id)

    def load_image(self, block_id: int, image: bytes) -> None:
        self.kv.load_image(block_id, image)

    def copy_block(self, src: int, dst: int) -> None:
        self.kv.copy_block(src, dst)
