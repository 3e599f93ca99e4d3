"""A running sequence's KV state in the engine: block table, global entries, window rings, private state.

``PagedSequence`` implements the model's ``SequenceKV``: the forward writes tokens, rings, entries,
partial groups and the replay tail through that protocol. Everything else that moves a sequence's
positions goes through the methods below, so the replay arithmetic exists once::

    positions  0 ............. enc_start ....... write_from ........ len(tokens)
               [ entries from the cache (never rewritten) ]
                               [ encoder window re-fed  ][ new tokens ]
    replay_start(n) = max(enc_start, n - window, 0): where the decoder replay starts when n tokens are fed

``PrivateState`` is everything but the global blocks: what a preempted sequence swaps to the host and
what an n > 1 fork copies.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from flashtier.engine.kv.block_table import BlockTable
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.layer_forward import LocalKeys
from flashtier.engine.kv.paged_entries import PagedEntries
from flashtier.engine.kv.window_rings import WindowRings


@dataclass(frozen=True)
class PrivateState:
    """A copy of a sequence's state outside its global blocks (host or device tensors)."""

    rings_data: torch.Tensor
    rings_pos: torch.Tensor
    partial: dict[int, PartialGroup | None]
    tokens: tuple[int, ...]
    enc_start: int
    dec_start: int
    write_from: int
    tail_x: torch.Tensor | None
    tail_pre: torch.Tensor | None
    counts: dict[int, int]  # KV source layer -> entries written


@dataclass(frozen=True)
class EncoderSnapshot:
    """A decoded encoder snapshot at point P (see snapshot_codec), ready to install."""

    point: int
    rings_data: torch.Tensor  # [n_encoder_layers, W, slot] uint8
    rings_pos: torch.Tensor  # [n_encoder_layers, W]
    partial: dict[int, PartialGroup | None]
    enc_start: int
    write_from: int
    tail_image: bytes  # the partial tail block's image (b"" when P is block-aligned)
    # encoder outputs of positions [P - rows, P) (rows <= window): the decoder replay's input when the
    # new prompt ends less than a window after P
    tail_x: torch.Tensor | None = None  # [rows, hc, D], compute dtype
    tail_pre: torch.Tensor | None = None  # [rows, hc]


@dataclass
class PagedSequence:
    """One sequence's KV state in the engine (implements the model's ``SequenceKV``)."""

    table: BlockTable
    stores: dict[int, PagedEntries]
    rings: WindowRings
    partial: dict[int, PartialGroup | None]
    tokens: list[int] = field(default_factory=list)
    enc_start: int = 0
    dec_start: int = 0
    write_from: int = 0
    tail_x: torch.Tensor | None = None
    tail_pre: torch.Tensor | None = None

    # ---- SequenceKV -------------------------------------------------------------------------------
    def ring_keys(self, layer: int, start: int) -> LocalKeys:
        return self.rings.keys(layer, start)

    def ring_write(self, layer: int, kv_raw: torch.Tensor, pos: torch.Tensor) -> None:
        self.rings.write(layer, kv_raw, pos)

    # ---- replay arithmetic ------------------------------------------------------------------------
    @property
    def window(self) -> int:
        return self.rings.window

    @property
    def replayed_from(self) -> int | None:
        """Provenance of the window state: None when exact (computed from the full history), else the
        position R of the encoder bounded replay it descends from (enc_start = R - window)."""
        return self.enc_start + self.window if self.enc_start > 0 else None

    def replay_start(self, n: int | None = None) -> int:
        """First position of the decoder replay once ``n`` tokens are fed (default: those fed now)."""
        n = len(self.tokens) if n is None else n
        return max(self.enc_start, n - self.window, 0)

    def rewind(self, prompt: list[int], r: int) -> None:
        """Encoder bounded replay from a cached prefix of ``r`` >= window tokens (blocks in the table).

        Keeps the entries below ``r``, re-feeds ``[r - W, r)`` with the encoder window truncated at
        ``r - W``. Mutates tokens, enc_start, write_from and the entry counts.
        """
        assert r >= self.window, f"bounded replay needs a hit of >= {self.window} tokens, got {r}"
        start = r - self.window
        self.write_from, self.enc_start = r, start
        self.tokens = list(prompt[:start])
        self._set_counts(r)

    def begin_decoder_replay(self, decoder_layers: range) -> int:
        """Start the decoder replay over the newest window: clear the decoder rings; returns its start."""
        d = self.replay_start()
        self.rings.clear(decoder_layers)
        self.dec_start = d
        return d

    def install_snapshot(self, snap: EncoderSnapshot, prompt: list[int]) -> None:
        """Continue exactly at ``snap.point``: encoder rings, partial groups, replay tail, tokens and
        entry counts (mutates all of them; the decoder rings are left to ``begin_decoder_replay``).

        The blocks below the point (and the tail block) must already be in the table.
        """
        n = snap.rings_data.shape[0]
        dev = self.rings.data.device
        self.rings.data[:n] = snap.rings_data.to(dev)
        self.rings.pos[:n] = snap.rings_pos.to(dev)
        self.partial = {src: g for src, g in snap.partial.items()}
        self.enc_start, self.write_from = snap.enc_start, min(snap.write_from, snap.point)
        self.tokens = list(prompt[: snap.point])
        self.tail_x = None if snap.tail_x is None else snap.tail_x.to(dev)
        self.tail_pre = None if snap.tail_pre is None else snap.tail_pre.to(dev)
        self._set_counts(snap.point)

    def _set_counts(self, position: int) -> None:
        for store in self.stores.values():
            store.count = store.count_at(position)

    # ---- private state ----------------------------------------------------------------------------
    def private_state(self) -> PrivateState:
        """Everything but the global blocks, copied (preemption swap-out, n > 1 forks). Mutates nothing."""
        return PrivateState(
            rings_data=self.rings.data.clone(),
            rings_pos=self.rings.pos.clone(),
            partial=copy.deepcopy(self.partial),
            tokens=tuple(self.tokens),
            enc_start=self.enc_start,
            dec_start=self.dec_start,
            write_from=self.write_from,
            tail_x=None if self.tail_x is None else self.tail_x.clone(),
            tail_pre=None if self.tail_pre is None else self.tail_pre.clone(),
            counts={src: s.count for src, s in self.stores.items()},
        )

    def restore_private_state(self, st: PrivateState) -> None:
        """Overwrite everything but the table with ``st`` (copied: ``st`` may be restored again)."""
        dev = self.rings.data.device
        self.rings.data.copy_(st.rings_data.to(dev))
        self.rings.pos.copy_(st.rings_pos.to(dev))
        self.partial = copy.deepcopy(st.partial)
        self.tokens = list(st.tokens)
        self.enc_start, self.dec_start, self.write_from = st.enc_start, st.dec_start, st.write_from
        self.tail_x = None if st.tail_x is None else st.tail_x.to(dev)
        self.tail_pre = None if st.tail_pre is None else st.tail_pre.to(dev)
        for src, n in st.counts.items():
            self.stores[src].count = n
