"""Entry writes of a decode part in a fixed shape: every row computes one entry, whatever it completes.

``batch_entries.write_entries`` gathers exactly the entries a step completes (``EntryWrites``, sized on the
host), which a CUDA graph cannot replay. In a decode-shaped step each sequence adds a few tokens (one, or a
verified chunk), so each row either completes an entry or (ratio 2, an even position) opens a group;
``DenseWrites`` gives every row an entry slot: a completing row its real (block, offset), any other row (and
every pad row) the null block's first slot, which no sequence reads. A ratio-2 row's first token is either an
earlier row of the same step (``partner``) or waits from an earlier step (the group its sequence opened then),
which comes as a tensor row instead of a ``PartialGroup``; the kv and gate rows of every row are returned, so
the caller turns the one of a sequence's last row, at an even position, into its new group after the step.

Same ops in the same order as ``write_entries`` (``project_pairs`` / ``pool_pairs`` / ``project_single``,
RoPE, the FP4 / MXFP4 records), only over all rows: the entries are identical when the ops are invariant to
the row count (engine/runner/decode_graphs.py's tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.model.block import Block
from flashtier.kernels.quant.fp4 import pack_fp4_record, quantize_fp4
from flashtier.kernels.quant.mxfp4 import pack_mxfp4_record, quantize_mxfp4


@dataclass(frozen=True)
class DenseWrites:
    """One KV source's entry slot per row of a decode part (module docstring). Every tensor has T rows."""

    block: torch.Tensor  # [T] int64 pool block of the entry the row completes (0: the null block)
    offset: torch.Tensor  # [T] int64 entry slot in the block (0 where block is 0)
    entry_pos: torch.Tensor  # [T] int64 entry index * ratio (its RoPE position)
    waiting_kv: torch.Tensor | None  # [T, hd] fp32 ratio 2: the first token's kv (zeros where none); else None
    waiting_z: torch.Tensor | None  # [T, hd] fp32 its gate scores
    partner: torch.Tensor | None  # [T] int64 ratio 2: the first token's row in this part (-1: waiting_*); else None


def write_dense(block: Block, h: torch.Tensor, w: DenseWrites, main: torch.Tensor, index: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Compute every row's entry from the attention input h [T, D] and store it at (w.block, w.offset).

    Mutates ``main`` [N, E, 288] and ``index`` [N, E, 68] at those slots (the null block's first slot for rows
    completing nothing). Returns ratio 2's (kv, z) [T, hd] of every row (the groups the caller may open), None
    for ratio 1.
    """
    comp, attn = block.attn.compressor, block.attn
    opened = None
    if comp.ratio == 1:
        latent = comp.project_single(h)
    else:
        kv, z = comp.project_pairs(h)
        in_step = (w.partner >= 0)[:, None]  # the pair's first token computed in this part (a multi-row sequence)
        at = w.partner.clamp(min=0)
        first_kv = torch.where(in_step, kv[at], w.waiting_kv.to(kv.dtype))
        first_z = torch.where(in_step, z[at], w.waiting_z.to(z.dtype))
        pairs_kv = torch.stack((first_kv, kv), dim=1)
        pairs_z = torch.stack((first_z, z), dim=1)
        latent = comp.pool_pairs(pairs_kv, pairs_z)
        opened = (kv, z)
    main_raw = attn.rope.apply(latent, w.entry_pos)
    index_raw = attn.indexer.project_k_raw(latent, w.entry_pos)
    main[w.block, w.offset] = pack_fp4_record(*quantize_fp4(main_raw.float()))
    index[w.block, w.offset] = pack_mxfp4_record(*quantize_mxfp4(index_raw.float()))
    return opened
