"""The global entries a step completes, for every sequence at once, written straight into the paged pool.

The batched form of ``layer_forward.compute_entries`` + ``GlobalEntries.write``: the compressor runs over all
rows of the part, the groups are gathered by the host-built ``EntryWrites`` (a pair's first token is either a
row of this step or a sequence's waiting ``PartialGroup``), and the FP4 main-KV and MXFP4 index-key records
land at their (block, offset) with one indexed store each. Same ops in the same order as the per-sequence
path (``Compressor.project_pairs`` / ``pool_pairs`` / ``project_single``), so the entries are identical.
"""

from __future__ import annotations

import torch

from flashtier.engine.model.block import Block
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.step_rows import EntryWrites
from flashtier.kernels.quant.fp4 import pack_fp4_record, quantize_fp4
from flashtier.kernels.quant.mxfp4 import pack_mxfp4_record, quantize_mxfp4


def _latents(block: Block, h: torch.Tensor, w: EntryWrites) -> tuple[torch.Tensor, list[PartialGroup]]:
    """Pre-RoPE latents [G, hd] of the entries, and the groups the step leaves open (in new_partial order)."""
    comp = block.attn.compressor
    if comp.ratio == 1:
        return comp.project_single(h[w.rows]), []
    kv, z = comp.project_pairs(h)
    open_kv, open_z = kv[w.new_partial_rows], z[w.new_partial_rows]  # one gather each, views below
    opened = [PartialGroup(open_kv[i], open_z[i], p) for i, p in enumerate(w.new_partial_pos)]
    if w.rows.numel() == 0:
        return kv.new_zeros(0, kv.shape[-1]), opened
    has_row = (w.partner >= 0)[:, None]
    first_kv, first_z = kv[w.partner.clamp(min=0)], z[w.partner.clamp(min=0)]
    if w.partials:
        waiting_kv = torch.stack([g.kv for g in w.partials]).to(kv.dtype)[w.partial_idx]
        waiting_z = torch.stack([g.score for g in w.partials]).to(z.dtype)[w.partial_idx]
        first_kv = torch.where(has_row, first_kv, waiting_kv)
        first_z = torch.where(has_row, first_z, waiting_z)
    pairs_kv = torch.stack((first_kv, kv[w.rows]), dim=1)
    pairs_z = torch.stack((first_z, z[w.rows]), dim=1)
    return comp.pool_pairs(pairs_kv, pairs_z), opened


def write_entries(
    block: Block, h: torch.Tensor, w: EntryWrites, main: torch.Tensor, index: torch.Tensor
) -> list[PartialGroup]:
    """Compute and store the entries of ``w`` from the attention input h [T, D] of the part's rows.

    Mutates ``main`` [N, E, 288] and ``index`` [N, E, 68] (one KV source's pool views) at the entries'
    (block, offset). Returns the groups opened by ``w.new_partial_rows``, which the caller installs as
    the sequences' partial groups.
    """
    latent, opened = _latents(block, h, w)
    if w.rows.numel():
        attn = block.attn
        main_raw = attn.rope.apply(latent, w.entry_pos)
        index_raw = attn.indexer.project_k_raw(latent, w.entry_pos)
        main[w.block, w.offset] = pack_fp4_record(*quantize_fp4(main_raw.float()))
        index[w.block, w.offset] = pack_mxfp4_record(*quantize_mxfp4(index_raw.float()))
    return opened
