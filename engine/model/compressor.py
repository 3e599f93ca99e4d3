"""The KV compressor of a global-KV source layer: m tokens -> one 512-latent entry (model.md §3.4).

- ratio 1 (layer 20, the CED decoder's KV): ``latent_t = RMSNorm(wkv(x_t))``, no gate.
- ratio 2 (layers 2, 8, 14): ``kv = wkv(x)``, ``z = wgate(x)`` in fp32; entry g pools tokens
  {2g, 2g+1} with a per-CHANNEL softmax over the group: ``RMSNorm(sum_t softmax_t(z[t, c]) kv[t, c])``.
  Groups do not overlap; a trailing odd token waits in ``PartialGroup`` for its partner.

Entry j is rotated at position ``j * ratio`` and stored FP4 (main KV); its indexer K comes from the
PRE-RoPE latent (see ``Indexer.project_k``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashtier.engine.model.config import ModelConfig
from flashtier.engine.model.norm import RMSNorm
from flashtier.engine.model.numerics import linear_up, up


@dataclass
class PartialGroup:
    """A ratio-2 group's first token, waiting for the second: its fp32 kv and gate score rows."""

    kv: torch.Tensor  # [hd] fp32
    score: torch.Tensor  # [hd] fp32
    position: int


class Compressor(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, dtype: torch.dtype):
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"compressor ratio must be 1 or 2, got {ratio}")
        self.ratio = ratio
        d, hd = cfg.hidden_size, cfg.head_dim
        self.wkv = nn.Linear(d, hd, bias=False, dtype=dtype)
        self.wgate = nn.Linear(d, hd, bias=False, dtype=dtype) if ratio == 2 else None
        self.norm = RMSNorm(hd, cfg.rms_norm_eps)

    def latents(
        self, h: torch.Tensor, pos: torch.Tensor, partial: PartialGroup | None
    ) -> tuple[torch.Tensor, torch.Tensor, PartialGroup | None]:
        """Entries completed by tokens h [T, D] at consecutive positions pos [T].

        Returns (latents [G, hd] pre-RoPE fp32, entry indices [G], the new partial group). For
        ratio 2 a chunk starting at an odd position needs the partial group of its predecessor;
        a missing or mismatched partial group is an internal error (assert).
        """
        if self.ratio == 1:
            return self.project_single(h), pos.clone(), None
        kv, z = self.project_pairs(h)
        start = int(pos[0]) if pos.numel() else 0
        if start % 2:
            assert partial is not None and partial.position == start - 1, "ratio-2 group lost its first token"
            kv = torch.cat((partial.kv[None], kv))
            z = torch.cat((partial.score[None], z))
            start -= 1
        elif partial is not None:
            raise AssertionError("partial group present at an even start position")
        n_full = kv.shape[0] // 2
        new_partial = None
        if kv.shape[0] % 2:
            new_partial = PartialGroup(kv[-1].clone(), z[-1].clone(), start + kv.shape[0] - 1)
        kv = kv[: 2 * n_full].view(n_full, 2, kv.shape[-1])
        z = z[: 2 * n_full].view(n_full, 2, z.shape[-1])
        entries = torch.arange(n_full, device=h.device) + start // 2
        return self.pool_pairs(kv, z), entries, new_partial

    # The pieces of ``latents``, also called by the batched forward (batch_entries.py) so both paths
    # run the same ops in the same order.
    def project_single(self, h: torch.Tensor) -> torch.Tensor:
        """Ratio 1: the latent of every row of h [T, D] -> [T, hd] fp32 (pre-RoPE)."""
        w = self.wkv.weight
        return self.norm(up(linear_up(h.to(w.dtype), w)))

    def project_pairs(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ratio 2: kv and gate scores [T, hd] fp32 of every row of h [T, D]."""
        return linear_up(up(h), self.wkv.weight), linear_up(up(h), self.wgate.weight)

    def pool_pairs(self, kv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Ratio 2: groups kv, z [G, 2, hd] -> latents [G, hd] (per-channel softmax over the pair, RMSNorm)."""
        return self.norm((torch.softmax(z, dim=1) * kv).sum(1))
